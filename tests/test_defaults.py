"""Every engine default has one source, threefold/config.py: the CLI, the server, EngineArgs and LLM() read it.

Two earlier commits fixed defaults that had drifted apart between these places; these tests compare each
front door's defaults with the config dataclasses' field defaults, so a literal written anywhere else fails.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from threefold.cli import build_parser
from threefold.config import DEFAULT_MODEL, CacheConfig, ModelConfig, SchedulerConfig
from threefold.engine.llm import LLM
from threefold.engine.llm_engine import EngineArgs
from threefold.model import registry


def config_defaults() -> dict[str, object]:
    """Field name -> default over the three engine configs (the names EngineArgs, LLM() and the CLI use)."""
    out: dict[str, object] = {}
    for config in (ModelConfig, CacheConfig, SchedulerConfig):
        for field in dataclasses.fields(config):
            assert field.name not in out, f"{field.name} is a field of two configs"
            out[field.name] = field.default
    return out


def drifted(defaults: dict[str, object]) -> list[str]:
    """The engine knobs whose default in `defaults` differs from the config's (missing counts as differing)."""
    missing = inspect.Parameter.empty
    return [name for name, default in config_defaults().items() if defaults.get(name, missing) != default]


def test_config_defaults_are_the_documented_ones():
    """The values themselves, so a change to them is a deliberate one (README and docs quote them)."""
    defaults = config_defaults()
    assert defaults["model"] == DEFAULT_MODEL
    assert DEFAULT_MODEL == "smollm2-135m"
    assert (defaults["block_size"], defaults["max_num_seqs"], defaults["max_num_batched_tokens"]) == (16, 256, 2048)


def test_registry_default_is_the_config_default():
    assert ModelConfig().model == registry.DEFAULT_MODEL
    assert registry.DEFAULT_MODEL in registry.REGISTRY


def test_engine_args_defaults_equal_the_configs():
    assert not drifted(dataclasses.asdict(EngineArgs()))


def test_llm_defaults_equal_the_configs():
    params = inspect.signature(LLM.__init__).parameters
    assert not drifted({name: param.default for name, param in params.items()})


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_cli_and_server_defaults_equal_the_configs(command):
    assert not drifted(vars(build_parser().parse_args([command])))


def test_bench_offline_default_model_is_the_config_default():
    ns = build_parser().parse_args(["bench", "offline"])
    assert ns.model == DEFAULT_MODEL


def test_a_drifted_default_is_caught():
    """The comparison can fail: a changed or a missing default is reported by name."""
    defaults = {**config_defaults(), "max_num_batched_tokens": 4096}
    del defaults["block_size"]
    assert drifted(defaults) == ["block_size", "max_num_batched_tokens"]


def test_serve_caps_prefill_per_step_unless_told_and_the_others_do_not():
    """`threefold serve` alone steps SERVING_PREFILL_TOKENS prompt tokens at a time (a burst's first
    prompts reach their first token sooner); an explicit --max-prefill-tokens wins; generate keeps none."""
    from threefold.cli import engine_args_from
    from threefold.config import SERVING_PREFILL_TOKENS
    from threefold.server.cli import serving_engine_args

    parser = build_parser()
    assert serving_engine_args(parser.parse_args(["serve"])).max_prefill_tokens == SERVING_PREFILL_TOKENS
    assert serving_engine_args(parser.parse_args(["serve", "--max-prefill-tokens", "64"])).max_prefill_tokens == 64
    assert engine_args_from(parser.parse_args(["generate"])).max_prefill_tokens is None
