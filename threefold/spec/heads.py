"""Draft heads that ride on the target: Medusa heads and an EAGLE head, as torch modules,
plus their on-disk form (model.safetensors + config.json).

Both read the target's final hidden state f_t (after the final norm, the input
of its LM head) and share the target's frozen embedding and LM head, so only a
few MB are trained and stored:

- Medusa (Cai et al. 2024): head i is a residual SiLU block; lm_head(head_i(f_t))
  predicts token t + i + 2 (the target itself predicts t + 1). Medusa-1 gives
  each head its own LM head initialised from the target's; sharing it keeps a
  head at hidden^2 weights (1.3 MB for SmolLM2) instead of hidden x vocab.
- EAGLE (Li et al. 2024): one decoder layer of the target's shape over
  fc(concat(embed(x_{t+1}), f_t)) regresses f_{t+1}; lm_head(f_hat_{t+1}) then
  drafts x_{t+2}, and the step repeats on its own output. The layer attends over
  the earlier (feature, token) pairs through a caller-supplied AttentionFn.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from threefold.errors import ThreefoldError
from threefold.model.config import ModelArchConfig
from threefold.model.llama import AttentionFn, DecoderLayer, Linear, RMSNorm, rope_tables

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
HEAD_METHODS = ("medusa", "eagle")
DRAFT_VOCAB_KEY = "draft_vocab"
"""In the weights file: int64 token ids ranked by how often the target wrote them in the heads'
training answers (most often first; tokens it never wrote are left out)."""


@dataclass
class HeadsConfig:
    method: str
    """medusa or eagle."""
    hidden_size: int
    vocab_size: int
    target: str
    """The target model these heads were trained for (its registry name)."""
    num_heads: int = 1
    """Medusa: heads (each drafts one position further); EAGLE: 1."""
    dtype: str = "float32"
    """Stored dtype (bfloat16 halves the files); loading always gives float32 modules."""
    recipe: dict = field(default_factory=dict)
    """How they were made: data, tokens, steps, wall time, command."""
    draft_vocab_size: int = 0
    """Draft over the first N tokens of the ranked draft vocabulary unless speculative_config says
    otherwise (0: the whole vocabulary)."""


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W zero-initialised so a fresh head starts as the identity (Medusa)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x: Tensor) -> Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ResBlock(hidden_size) for _ in range(num_heads))

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def forward(self, hidden: Tensor) -> Tensor:
        """[N, hidden] final hidden states -> [num_heads, N, hidden] inputs of the shared LM head."""
        return torch.stack([block(hidden) for block in self.blocks])


class EagleHead(nn.Module):
    """fc(concat(embed(x_{t+1}), f_t)) -> one decoder layer -> f_hat_{t+1} (no final norm:
    the target's f is already normed and the LM head reads it as is)."""

    rope_cos: Tensor
    rope_sin: Tensor

    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        hidden = arch.hidden_size
        self.fc = Linear(2 * hidden, hidden)
        self.layer = DecoderLayer(arch, 0)
        for module in self.layer.modules():  # the target's layer classes leave norms uninitialised
            if isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        if self.layer.self_attn.qk_norm_weight is not None:
            nn.init.ones_(self.layer.self_attn.qk_norm_weight)
        self.arch = arch
        cos, sin = rope_tables(arch, arch.max_position_embeddings, "cpu")
        self.register_buffer("rope_cos", cos.float(), persistent=False)
        self.register_buffer("rope_sin", sin.float(), persistent=False)

    def forward(self, features: Tensor, token_embeds: Tensor, positions: Tensor, attention: AttentionFn) -> Tensor:
        """features f_t [T, hidden], token_embeds embed(x_{t+1}) [T, hidden], positions [T]
        (x_{t+1}'s position) -> predicted f_{t+1} [T, hidden]."""
        x = self.fc(torch.cat([token_embeds, features], dim=-1))
        rotary = _Rotary(self.rope_cos[positions].to(x.dtype)[:, None], self.rope_sin[positions].to(x.dtype)[:, None])
        hidden, residual = self.layer(x, None, rotary, attention)
        return hidden + residual


class _Rotary:
    """RoPE in HF's rotate_half convention, out of place so that it differentiates (the
    target's Rotary writes into preallocated outputs). cos, sin [T, 1, head_dim / 2]."""

    def __init__(self, cos: Tensor, sin: Tensor) -> None:
        self.cos, self.sin = cos, sin

    def __call__(self, x: Tensor) -> Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * self.cos - x2 * self.sin, x2 * self.cos + x1 * self.sin], dim=-1)


def build_heads(config: HeadsConfig, arch: ModelArchConfig) -> nn.Module:
    if config.method == "medusa":
        return MedusaHeads(config.hidden_size, config.num_heads)
    return EagleHead(arch)


def save_heads(path: Path, config: HeadsConfig, heads: nn.Module, draft_vocab: Tensor | None = None) -> None:
    """Ownership: `path` is created; existing files of the same names are replaced. draft_vocab:
    the ranked token ids (DRAFT_VOCAB_KEY), kept beside the weights."""
    path.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, config.dtype)
    state = {name: tensor.detach().to(dtype).contiguous() for name, tensor in heads.state_dict().items()}
    if draft_vocab is not None:
        state[DRAFT_VOCAB_KEY] = draft_vocab.to(torch.int64).contiguous()
    save_file(state, str(path / WEIGHTS_FILE), metadata={"method": config.method})
    (path / CONFIG_FILE).write_text(json.dumps(asdict(config), indent=2) + "\n")


def resolve_heads(name_or_path: str | Path) -> Path:
    """A heads directory, or a name under $THREEFOLD_HOME/heads (where `make heads` puts them)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    from threefold.env import Env

    named = Env.read().home / "heads" / str(name_or_path)
    return named if named.is_dir() else path


def load_heads(path: str | Path, arch: ModelArchConfig, target_name: str | None = None,
               method: str | None = None) -> tuple[HeadsConfig, nn.Module]:
    """Load heads for a target of shape `arch`; a mismatch is a clear ThreefoldError."""
    path = resolve_heads(path)
    param = "speculative_config.model"
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise ThreefoldError(f"{path} holds no draft heads ({CONFIG_FILE} + {WEIGHTS_FILE}); train them with "
                             f"`threefold train-draft`.", param=param)
    config = HeadsConfig(**json.loads((path / CONFIG_FILE).read_text()))
    if method is not None and config.method != method:
        raise ThreefoldError(f"{path} holds {config.method} heads, not {method}.", param=param)
    if (config.hidden_size, config.vocab_size) != (arch.hidden_size, arch.vocab_size):
        raise ThreefoldError(f"heads in {path} were trained for hidden size {config.hidden_size} / vocabulary "
                             f"{config.vocab_size} ({config.target}); the target has {arch.hidden_size} / "
                             f"{arch.vocab_size}.", param=param)
    if target_name is not None and config.target != target_name:
        raise ThreefoldError(f"heads in {path} were trained for {config.target!r}, not {target_name!r}.", param=param)
    heads = build_heads(config, arch)
    state = load_file(str(path / WEIGHTS_FILE))
    state.pop(DRAFT_VOCAB_KEY, None)
    heads.load_state_dict({name: t.float() for name, t in state.items()})
    return config, heads.eval().requires_grad_(False)


def draft_vocab_ids(path: str | Path, config: HeadsConfig, size: int | None) -> Tensor | None:
    """The token ids the heads in `path` draft over: the first `size` of their ranked draft vocabulary
    (None: the heads' default, config.draft_vocab_size; 0: None, the whole vocabulary)."""
    size = config.draft_vocab_size if size is None else size
    if size == 0 or size >= config.vocab_size:
        return None
    from safetensors import safe_open

    with safe_open(str(resolve_heads(path) / WEIGHTS_FILE), "pt") as weights:
        names = list(weights.keys())  # a safe_open handle has no __contains__
        ranked = weights.get_tensor(DRAFT_VOCAB_KEY) if DRAFT_VOCAB_KEY in names else None
    param = "speculative_config.draft_vocab_size"
    if ranked is None:
        raise ThreefoldError(f"the heads in {path} carry no draft vocabulary (trained before it was kept); use "
                             f"draft_vocab_size=0 or retrain them with `threefold train-draft`.", param=param)
    if size > len(ranked):
        raise ThreefoldError(f"draft_vocab_size={size}, but the target wrote only {len(ranked)} distinct tokens "
                             f"in the training answers of the heads in {path}; use at most {len(ranked)}, or 0 "
                             f"for the whole vocabulary.", param=param)
    return ranked[:size]
