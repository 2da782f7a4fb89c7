"""`threefold chat`: an interactive conversation; tokens stream to the terminal as they come."""

from __future__ import annotations

import sys

from threefold.engine.llm_engine import EngineArgs, LLMEngine
from threefold.engine.outputs import RequestOutputKind
from threefold.errors import ThreefoldError
from threefold.sample.params import SamplingParams


def run_chat(args: EngineArgs, params: SamplingParams, session_id: str) -> int:
    engine = LLMEngine.from_args(args)
    print(f"threefold chat with {engine.model_name} — empty line or Ctrl-D to quit", file=sys.stderr)
    messages: list[dict] = []
    for turn in range(10**9):
        try:
            user = input("you> ").strip()
        except EOFError:
            break
        if not user:
            break
        messages.append({"role": "user", "content": user})
        prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages), add_special_tokens=False)
        try:
            reply = _stream_reply(engine, f"{session_id}-{turn}", prompt, params)
        except ThreefoldError as exc:
            print(f"error: {exc.message}", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply})
    return 0


def _stream_reply(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams) -> str:
    engine.add_request(request_id, prompt, params, output_kind=RequestOutputKind.DELTA)
    pieces: list[str] = []
    sys.stdout.write("bot> ")
    while engine.has_unfinished_requests():
        for output in engine.step():
            pieces.append(output.outputs[0].text)  # only the new text
            sys.stdout.write(pieces[-1])
            sys.stdout.flush()
    sys.stdout.write("\n")
    return "".join(pieces)
