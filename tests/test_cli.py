"""The `threefold` command line, run as a user would (a real subprocess on the real model)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from threefold.cli import parse_bytes

CLI = [sys.executable, "-m", "threefold.cli"]
ENGINE = ["--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "512"]


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], input=stdin, capture_output=True, text=True, timeout=300,
                          check=False)  # callers assert on the exit code


def test_generate_prints_the_completion():
    result = run("generate", *ENGINE, "--max-tokens", "8", "--prompt", "The capital of France is")
    assert result.returncode == 0, result.stderr
    assert "### prompt: The capital of France is" in result.stdout
    assert "[8 tokens, finish_reason=length]" in result.stdout


def test_chat_streams_replies_and_keeps_the_conversation():
    result = run("chat", *ENGINE, "--max-tokens", "6", stdin="Hello!\nAnd again?\n\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("bot> ") == 2
    assert len(result.stdout.replace("you> ", "").replace("bot> ", "").strip()) > 0


def test_models_lists_the_registry():
    result = run("models")
    assert result.returncode == 0, result.stderr
    for name in ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
        assert name in result.stdout


def test_bad_input_exits_with_a_clear_message():
    result = run("generate", "--model", "no-such-model", "--prompt", "x")
    assert result.returncode == 2
    assert "no-such-model" in result.stderr and "smollm2-135m" in result.stderr
    result = run("generate", *ENGINE, "--temperature", "-1", "--prompt", "x")
    assert result.returncode == 2 and "temperature" in result.stderr


@pytest.mark.parametrize("text,expected", [("2GiB", 2 << 30), ("512MiB", 512 << 20), ("1000", 1000),
                                           ("1.5kb", 1500)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


def test_parse_bytes_rejects_nonsense():
    with pytest.raises(argparse.ArgumentTypeError, match="2GiB"):
        parse_bytes("lots")
