"""The guard's per-layer probe: one whole sequence, every layer exact but one, which reads K/V
as its codec's cache would return them to each row; layers before it are computed once.

What a row reads (the same rules the engine's attention follows, worker/attention.py and
worker/kivi_attention.py; tests/test_kv_guard.py checks the two agree):

    windowless codec    every earlier key and value round-tripped (codec.round_trip)
    windowed (KIVI)     row p reads keys below nq(p + 1) = floor_B(p + 1 - L) from whole encoded
                        blocks (codec.encode / read_blocks), the rest exact (kv/window.py: window_lag)

Layer l's added KL needs only layers l.. recomputed: the inputs of every layer under the exact
cache are kept from one forward, so probing all layers costs about half a forward each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from threefold.kv.codec import KVCodec
from threefold.kv.window import window_dtype, window_lag
from threefold.model.llama import CausalLM, Rotary


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of one sequence: q [n, H, d], k/v [n, kvh, d] -> [n, H, d]."""
    # [1, heads, n, d]: SDPA's batched 4-D form (the 3-D one takes a slower path on CPU, measured)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=True, enable_gqa=True)
    return out[0].transpose(0, 1)


def windowed_attention(codec, block_size: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention where row p reads keys below nq(p + 1) from the codec's blocks, the rest exact."""
    n, kvh, d = k.shape
    k, v = (t.to(window_dtype(t.dtype)).to(t.dtype) for t in (k, v))  # what the engine's window holds
    num_blocks = -(-n // block_size)
    pad = num_blocks * block_size - n
    storage = codec.allocate(num_blocks, block_size, k.device)
    ids = torch.arange(num_blocks, device=k.device)
    shape = (num_blocks, block_size, kvh, d)
    codec.encode(storage, ids, F.pad(k, (0, 0, 0, 0, 0, pad)).view(shape), F.pad(v, (0, 0, 0, 0, 0, pad)).view(shape))
    kq, vq = (t[:n].to(q.dtype) for t in codec.read_blocks(storage, ids))
    rows = torch.arange(n, device=q.device)
    nq = ((rows + 1 - window_lag(codec.residual, block_size)) // block_size * block_size).clamp(min=0)
    quantized = rows[None, :] < nq[:, None]  # [row, key]
    exact = ~quantized & (rows[None, :] <= rows[:, None])
    group = q.shape[1] // kvh
    qg = q.view(n, kvh, group, d).transpose(0, 1)  # [kvh, n, group, d]
    scale = d ** -0.5

    def scores(keys: torch.Tensor) -> torch.Tensor:  # [kvh, group, row, key]
        return torch.einsum("hpgd,jhd->hgpj", qg, keys) * scale

    logits = torch.where(quantized, scores(kq), torch.where(exact, scores(k), float("-inf")))
    weights = torch.softmax(logits, dim=-1)
    out = torch.einsum("hgpj,jhd->phgd", weights * quantized, vq) + torch.einsum("hgpj,jhd->phgd", weights * exact, v)
    return out.reshape(n, kvh * group, d)


class LayerProbe:
    """Log-distributions of one sequence with one layer's K/V through a codec (see the docstring)."""

    def __init__(self, model: CausalLM, token_ids: list[int], block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        ids = torch.tensor(token_ids)
        assert model.rope_cos is not None and model.rope_sin is not None, "a loaded model has its RoPE tables"
        self.rotary = Rotary(torch.arange(len(token_ids)), model.rope_cos, model.rope_sin, model.kernels)
        self.inputs: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        """(hidden, residual) entering each layer, exact cache."""
        with torch.inference_mode():
            hidden, residual = model.embed_tokens(ids), None
            for layer in model.layers:
                self.inputs.append((hidden.clone(), None if residual is None else residual.clone()))
                hidden, residual = layer(hidden, residual, self.rotary, self._attention(None, -1))
            self.reference = self._finish(hidden, residual)

    def _attention(self, codec: KVCodec | None, probed: int):
        def attend(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if layer_idx != probed or codec is None:
                return exact_attention(q, k, v)
            if codec.window_tokens(self.block_size):
                return windowed_attention(codec, self.block_size, q, k, v)
            return exact_attention(q, *codec.round_trip(k, v))
        return attend

    def _finish(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        final = self.model.norm(hidden) if residual is None else self.model.norm(hidden, residual)[0]
        return torch.log_softmax(self.model.compute_logits(final[:-1]), dim=-1)  # [n - 1, vocab] fp32

    def kl(self, layer_idx: int, codec: KVCodec) -> float:
        """Mean KL(exact || layer `layer_idx` through `codec`) per position, nats."""
        with torch.inference_mode():
            hidden, residual = self.inputs[layer_idx]
            hidden, residual = hidden.clone(), None if residual is None else residual.clone()
            attention = self._attention(codec, layer_idx)
            for layer in self.model.layers[layer_idx:]:
                hidden, residual = layer(hidden, residual, self.rotary, attention)
            q = self._finish(hidden, residual)
            p = self.reference
            return float((p.exp() * (p - q)).sum(-1).mean())
