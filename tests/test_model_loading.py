"""Loading errors, dtype rules, generation_config, tokenizer and chat template."""

from __future__ import annotations

import json

import pytest
import torch

from threefold.cpu import cpu_info
from threefold.errors import ModelNotFoundError, ThreefoldError
from threefold.model.loader import LoadedModel, load_model

from model_fixtures import TINY_GENERATION_CONFIG, make_tiny_checkpoint, smollm2_gguf_path


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> LoadedModel:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")
    return load_model(str(path))


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model("smollm2-135m", max_model_len=1024)


def _copy_checkpoint(src, dst, edit_config=None):
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    if edit_config:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_generation_config_eos_list_and_sampling_defaults(tiny_llama):
    assert tiny_llama.eos_token_ids == [2, 0]  # config eos 2, then the generation_config list
    expected = {k: TINY_GENERATION_CONFIG[k] for k in ("temperature", "top_p", "top_k", "repetition_penalty")}
    assert {k: tiny_llama.generation_defaults[k] for k in expected} == expected
    assert "eos_token_id" not in tiny_llama.generation_defaults


def test_hf_dir_loads_in_checkpoint_dtype_and_eval(tiny_llama):
    assert tiny_llama.config.dtype == torch.float32  # save_pretrained wrote float32
    assert not tiny_llama.model.training
    assert all(not p.requires_grad for p in tiny_llama.model.parameters())
    assert tiny_llama.max_model_len == 256 and tiny_llama.name == "llama"


def test_fp16_checkpoint_never_computes_in_fp16_on_cpu(tmp_path):
    """bf16 where the CPU has native bf16, else fp32 (tests/test_dtype_policy.py has the rules)."""
    loaded = load_model(str(make_tiny_checkpoint(tmp_path / "fp16", "fp16")))
    assert loaded.config.dtype == (torch.bfloat16 if cpu_info().native_bf16 else torch.float32)
    assert loaded.model.layers[0].self_attn.qkv_proj.weight.dtype == loaded.config.dtype
    with pytest.raises(ThreefoldError, match="float16 is not supported on CPU"):
        load_model(str(tmp_path / "fp16"), dtype="float16")


def test_unsupported_architecture_is_clear(tiny_llama, tmp_path):
    src = tmp_path / "src"
    make_tiny_checkpoint(src, "llama")
    bad = _copy_checkpoint(src, tmp_path / "gpt2", lambda c: c.update(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ThreefoldError, match=r"unsupported architecture.*GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(str(bad))
    rope = _copy_checkpoint(
        src, tmp_path / "yarn", lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0})
    )
    with pytest.raises(ThreefoldError, match=r"unsupported rope_scaling type 'yarn'.*llama3"):
        load_model(str(rope))


def test_missing_model_and_files_are_clear(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"no model named 'no-such-model'.*smollm2-135m"):
        load_model("no-such-model")
    with pytest.raises(ModelNotFoundError, match=r"no config.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ThreefoldError):
        load_model(str(tmp_path))
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(ThreefoldError, match="not a GGUF file"):
        load_model(str(not_gguf))


def test_missing_shard_tensor_is_clear(tmp_path):
    src = make_tiny_checkpoint(tmp_path / "sharded", "sharded")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.mlp.down_proj.weight"]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ThreefoldError, match=r"missing tensor 'model.layers.1.mlp.down_proj.weight'"):
        load_model(str(src))


def test_smollm2_metadata(smollm2):
    assert smollm2.name == "smollm2-135m"
    assert smollm2.max_model_len == 1024  # min(8192, user's 1024)
    # quantized GGUF, dtype="auto": bf16 compute only where the CPU has native bf16
    assert smollm2.config.dtype == (torch.bfloat16 if cpu_info().native_bf16 else torch.float32)
    assert smollm2.generation_defaults == {}
    tok = smollm2.tokenizer
    # SmolLM2-Instruct: eos 2 is <|im_end|>, the end of an assistant turn; 0 is <|endoftext|>.
    assert smollm2.eos_token_ids == [2, 0]
    assert tok.convert_ids_to_tokens([2, 0]) == ["<|im_end|>", "<|endoftext|>"]
    assert tok.vocab_size == 49152 and tok.bos_token_id == 1
    assert len(smollm2.fingerprint) == 64


def test_fingerprint_is_stable_and_dtype_specific(smollm2):
    """Recomputed from the file alone (as another process would): same value; another
    precision gives other KV values, so another fingerprint."""
    from dataclasses import replace

    from threefold.model.loader import fingerprint

    assert fingerprint([smollm2_gguf_path()], smollm2.precision) == smollm2.fingerprint
    other = torch.float32 if smollm2.precision.compute == torch.bfloat16 else torch.bfloat16
    assert fingerprint([smollm2_gguf_path()], replace(smollm2.precision, compute=other)) != smollm2.fingerprint


def test_smollm2_tokenizer_roundtrip_and_chat_template(smollm2):
    tok = smollm2.tokenizer
    text = "Hello, world! def f(x):\n    return x ** 2"
    assert tok.decode(tok.encode(text)) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.startswith("<|im_start|>system\n")  # SmolLM2's template adds a default system turn
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids.count(1) == 3  # <|im_start|> encoded as one special token per turn
    # Incremental detokenization through the backend gives the same text.
    from tokenizers.decoders import DecodeStream

    stream = DecodeStream(skip_special_tokens=False)
    pieces = [stream.step(tok.backend, i) for i in ids]
    assert "".join(p for p in pieces if p) == tok.decode(ids, skip_special_tokens=False) == prompt


def test_missing_chat_template_is_clear(tiny_llama):
    tok = tiny_llama.tokenizer
    saved, tok.hf.chat_template = tok.hf.chat_template, None
    try:
        with pytest.raises(ThreefoldError, match="no chat template") as err:
            tok.apply_chat_template([{"role": "user", "content": "hi"}])
        assert err.value.param == "messages"
    finally:
        tok.hf.chat_template = saved


def test_max_model_len_bounds_rope_table(smollm2):
    assert smollm2.model.rope_cos.shape == (1024, 32)
    with pytest.raises(ThreefoldError, match="max_model_len must be positive"):
        load_model("smollm2-135m", max_model_len=0)


def test_gguf_tokenizer_cache_gives_the_same_tokenizer(tmp_path):
    """The converted GGUF tokenizer is saved and reloaded from the cache dir: both must
    agree on special ids, the chat template and encodings."""
    from threefold.model.tokenizer import Tokenizer

    cache = tmp_path / "tok"
    fresh = Tokenizer.from_gguf(smollm2_gguf_path(), cache_dir=cache)
    assert (cache / "tokenizer.json").is_file()
    cached = Tokenizer.from_gguf(smollm2_gguf_path(), cache_dir=cache)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Naïve café? 123"}]
    prompt = fresh.apply_chat_template(messages)
    assert cached.apply_chat_template(messages) == prompt
    assert cached.encode(prompt) == fresh.encode(prompt)
    assert (cached.bos_token_id, cached.eos_token_id, cached.all_special_ids, cached.vocab_size) == (
        fresh.bos_token_id, fresh.eos_token_id, fresh.all_special_ids, fresh.vocab_size)


def test_gguf_file_parser_matches_the_gguf_package():
    """Our fast metadata/tensor parser against gguf.GGUFReader on the real file."""
    import numpy as np
    from gguf import GGUFReader

    from threefold.model.gguf_file import GGUFFile

    ours, theirs = GGUFFile(smollm2_gguf_path()), GGUFReader(smollm2_gguf_path())
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):
            assert ours.metadata[key] == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and a.data.dtype == b.data.dtype
        assert np.array_equal(a.data, b.data), a.name


def test_chunked_dequantization_matches_gguf():
    """Our chunked call into gguf's dequantizers gives gguf.quants.dequantize's values
    exactly, for every tensor type in the SmolLM2 file (Q4_1, Q8_0, F32)."""
    import numpy as np
    from gguf.quants import dequantize

    from threefold.model.gguf_file import GGUFFile
    from threefold.model.gguf_loader import dequantize_rows

    file = GGUFFile(smollm2_gguf_path())
    seen = set()
    for tensor in file.tensors:
        if tensor.tensor_type in seen:
            continue
        seen.add(tensor.tensor_type)
        expected = dequantize(tensor.data, tensor.tensor_type)
        actual = dequantize_rows(tensor.data, tensor.tensor_type)
        assert actual.dtype == np.float32 and actual.flags.writeable
        assert np.array_equal(actual, expected), tensor.name
    assert len(seen) == 3
