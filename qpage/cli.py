"""``qpage`` command line. Options and their defaults are read off the config dataclasses and
SamplingParams, so each default is written once."""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import time
import types
import typing
from collections.abc import Sequence
from typing import Any

from qpage.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig, field_doc

ENGINE_FIELDS: dict[type, tuple[str, ...]] = {
    ModelConfig: ("model", "dtype", "max_model_len", "allow_pickle", "device", "attention_backend",
                  "dequantize_weights"),
    CacheConfig: ("kv_cache_memory", "enable_prefix_caching", "kv_cache_dtype", "kv_cache_scales", "kv_cache_rotation"),
    SchedulerConfig: ("max_num_seqs", "max_num_batched_tokens"),
    ParallelConfig: ("tensor_parallel_size", "distributed_timeout"),
    EngineConfig: ("seed", "logprobs_mode"),
}
SAMPLING_FIELDS = (
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "stop", "ignore_eos", "n", "logprobs",
)
# At a prompt people expect a whole answer (as from ollama, llama-cli or a chat endpoint), so
# the CLI runs to the end-of-sequence token, with ollama's repetition penalty of 1.1 so that
# greedy decoding of a small model does not loop until the context is full. The penalty has
# vLLM's meaning (every prompt and output token, where ollama takes the last 64). The Python
# API keeps vLLM's defaults (16 tokens, no penalty).
CLI_SAMPLING = {
    "max_tokens": (None, "until the end-of-sequence token, at most max_model_len; 16 in the Python API"),
    "repetition_penalty": (1.1, "1.1 against repetition loops (ollama's value, applied as vLLM does to every "
                                "prompt and output token); 1.0 in the Python API"),
}


class VersionAction(argparse.Action):
    """``--version``: the version and what this machine can run, then exit."""

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        from qpage.sysinfo import report

        print(report())
        parser.exit()


def _base_type(tp: Any) -> Any:
    """int for 'int | None', str for 'int | str' (parsed later), list[str] -> str."""
    if isinstance(tp, str):
        tp = eval(tp, vars(typing))  # annotations are strings under `from __future__`
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return str if len(args) > 1 else _base_type(args[0])
    if typing.get_origin(tp) is list:
        return str
    return tp


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, names: Sequence[str],
                       overrides: dict[str, tuple[Any, str]] | None = None) -> None:
    """One option per field, its default and help read off ``cls``; ``overrides`` maps a field
    to (default, how the help states it) where a command differs from the dataclass."""
    hints = {f.name: f for f in dataclasses.fields(cls)}
    for name in names:
        f = hints[name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        shown = str(default)
        if overrides and name in overrides:
            default, shown = overrides[name]
        flag = "--" + name.replace("_", "-")
        help_ = f"{field_doc(cls, name)} (default: {shown})"
        tp = _base_type(f.type)
        if tp is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_)
        elif name == "stop":
            parser.add_argument(flag, action="append", default=None, help=help_)
        else:
            parser.add_argument(flag, type=tp, default=default, help=help_)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    for cls, names in ENGINE_FIELDS.items():
        add_dataclass_args(parser, cls, names)
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, as vLLM\'s speculative_config, e.g. \'{"method": "ngram", '
                             '"num_speculative_tokens": 4}\' (default: off)')


def build_engine_config(args: argparse.Namespace) -> EngineConfig:
    def part(cls: type) -> Any:
        return cls(**{n: getattr(args, n) for n in ENGINE_FIELDS[cls]})

    return EngineConfig(model=part(ModelConfig), cache=part(CacheConfig), scheduler=part(SchedulerConfig),
                        parallel=part(ParallelConfig), seed=args.seed,
                        logprobs_mode=args.logprobs_mode,
                        speculative_config=args.speculative_config)


def build_llm(args: argparse.Namespace) -> Any:
    from qpage import LLM

    kwargs = {n: getattr(args, n) for names in ENGINE_FIELDS.values() for n in names}
    return LLM(**kwargs, speculative_config=args.speculative_config)


def sampling_from_args(args: argparse.Namespace) -> Any:
    from qpage import SamplingParams

    return SamplingParams(**{n: getattr(args, n) for n in SAMPLING_FIELDS})


def _parser() -> argparse.ArgumentParser:
    from qpage.sampling_params import SamplingParams

    p = argparse.ArgumentParser(prog="qpage", description="Quantization-first, low-memory LLM inference")
    p.add_argument("--version", action=VersionAction, nargs=0,
                   help="print the version, torch, the CPU's features and the kernel paths this machine runs")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("version", help="same as --version")
    gen = sub.add_parser("generate", help="complete prompts (offline batch) and print the text")
    gen.add_argument("prompts", nargs="*", help="prompts; read from stdin, one per line, if none")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    chat = sub.add_parser("chat", help="interactive chat, streaming tokens as they come")
    chat.add_argument("--system", default=None, help="system prompt")
    for sp in (gen, chat):
        add_engine_args(sp)
        add_dataclass_args(sp, SamplingParams, SAMPLING_FIELDS, CLI_SAMPLING)
    from qpage import cli_quant, cli_serve

    cli_quant.add_parsers(sub)
    cli_serve.add_parsers(sub, add_engine_args)
    return p


def cmd_generate(args: argparse.Namespace) -> int:
    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("qpage generate: give at least one prompt", file=sys.stderr)
        return 2
    llm = build_llm(args)
    params = sampling_from_args(args)
    t0 = time.perf_counter()
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": q}] for q in prompts], params, use_tqdm=len(prompts) > 1)
    else:
        outs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    dt = time.perf_counter() - t0
    n_out = 0
    for prompt, out in zip(prompts, outs, strict=True):
        for comp in out.outputs:
            n_out += len(comp.token_ids)
            label = f"[{comp.index}] " if len(out.outputs) > 1 else ""
            print(f"--- {prompt!r}\n{label}{comp.text}  ({comp.finish_reason})")
    print(f"qpage: {len(prompts)} prompt(s), {n_out} tokens in {dt:.2f}s ({n_out / dt:.1f} tok/s)", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    llm = build_llm(args)
    engine = llm.llm_engine
    params = sampling_from_args(args)
    messages: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    print("qpage chat: type a message; Ctrl-C stops an answer, /reset clears the history, /exit or Ctrl-D "
          "quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        prompt = llm.apply_chat_template(messages)
        try:
            rid = engine.add_request(prompt, params, add_special_tokens=False)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            messages.pop()
            continue
        reply = _stream(engine, rid)
        messages.append({"role": "assistant", "content": reply})


def _stream(engine: Any, rid: str) -> str:
    """Print the answer as it comes; Ctrl-C stops it between two engine steps (a step is never
    cut in the middle, so the KV cache and the prefix cache stay whole) and the chat goes on."""
    printed, text, interrupted = 0, "", []
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.append(True))
    try:
        while engine.has_unfinished_requests():
            if interrupted:
                engine.abort_request(rid)
                sys.stdout.write(text[printed:] + "\n")
                print("(stopped)", file=sys.stderr)
                return text
            for out in engine.step():
                if out.request_id != rid:
                    continue
                parent = engine.outputs.parents.get(rid)
                text = out.outputs[0].text
                stable = parent.detoks[0].stable_text(out.finished) if parent and parent.detoks[0] else text
                sys.stdout.write(stable[printed:])
                sys.stdout.flush()
                printed = len(stable)
                if out.finished:
                    sys.stdout.write(text[printed:] + "\n")
                    if out.outputs[0].finish_reason == "length":
                        print("(cut: --max-tokens or the context is reached)", file=sys.stderr)
                    return text
    finally:
        signal.signal(signal.SIGINT, previous)
    return text


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "version":
        from qpage.sysinfo import report

        print(report())
        return 0
    if args.command in ("quantize", "inspect", "eval"):
        from qpage import cli_quant

        return cli_quant.run(args)
    from qpage import cli_serve

    if args.command in cli_serve.COMMANDS:
        return cli_serve.run(args, build_engine_config)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        return cmd_chat(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"qpage: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
