"""The `tandem` command line.

Each sub-command is a small function; the work lives in the library. Problems a user can fix
(`TandemError`) print one clear message to stderr and exit with code 2, like argparse's own usage
errors; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import NoReturn

from tandem import __version__
from tandem.config.alloc import parse_allocation
from tandem.config.keys_doc import keys_markdown
from tandem.config.loader import to_yaml
from tandem.errors import ConfigError, TandemError
from tandem.fleet.run_file import ControllerClient, read_controller_file
from tandem.launch.affinity import apply_cpu_affinity_from_env
from tandem.launch.allocator import reexec_with_allocator
from tandem.launch.scheduler import ENV_SERVE_API_KEY
from tandem.rl.console import CONTROLLER_LOG, setup_console

# A sub-command imports its heavy rooms (torch, transformers) when it runs, so that `tandem --help`,
# `show-config` and `alloc` answer at once; each such import says what it defers.

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C

TRAIN_USAGE = """usage: tandem train CONFIG.yaml [key=value ...]

Runs asynchronous RL: launches the inference servers and trainer ranks, trains, syncs weights,
evaluates. For example:

    tandem init-model runs/base --preset small
    tandem train examples/demo.yaml actor.path=runs/base train.total_steps=50

Every key with its type, default and range:  tandem show-config --keys  (docs/configuration.md)
A config resolved and checked, without running:  tandem show-config CONFIG.yaml [key=value ...]
Guides: docs/rl.md (runs, resuming, outputs), docs/configuration.md; example configs in examples/.
"""

# `tandem serve` flags that the launcher sets for every server it starts, and the key to use instead.
LAUNCHER_FLAGS = {
    "--model": "actor.path", "--model-path": "actor.path",
    "--host": "the launcher (127.0.0.1, or the node's address towards cluster.host_ip)",
    "--host-towards": "the launcher (the node's address towards cluster.host_ip)",
    "--port": "the launcher (a free port per server)", "--api-key": "rollout.api_key",
    "--device": "experiment.device",
}


def main(argv: Sequence[str] | None = None) -> int:
    apply_cpu_affinity_from_env()  # launched servers may be pinned to their cores
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except TandemError as exc:
        print(f"tandem {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # Ctrl-C before a command set up its own handling: nothing to resume
        print(f"\ntandem {args.command}: interrupted", file=sys.stderr)
        _leave_without_finalizing(EXIT_INTERRUPTED)
    finally:
        # The interpreter's last garbage collection walks every object torch and transformers
        # made (~3 s on 2 busy cores after a run): nothing is left to collect, so skip it.
        import gc

        gc.freeze()


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) back until the block ends, then raise it as KeyboardInterrupt.

    For the seconds-long imports of torch and transformers: a KeyboardInterrupt raised
    inside a module's import can be swallowed by a library's broad `except`, leaving numpy or
    torch half imported, and the import goes on to fail with an unrelated error (seen: exit 1
    with "module 'numpy' has no attribute 'minimum'" for a Ctrl-C 2 s after `tandem train`
    started) instead of the clean exit 130. Off the main thread, or where SIGINT is ignored, the
    block runs as it is."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt


def _leave_without_finalizing(code: int) -> NoReturn:
    """Exit at once, skipping the interpreter's finalization. A Ctrl-C that lands while torch or
    transformers is half imported can leave their extension state such that finalization aborts
    (SIGABRT, "Python runtime state: finalizing", seen about once in 30 interrupted starts under
    load); nothing has been started yet that finalization would clean up, so logs and streams are
    flushed and the process leaves."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Asynchronous RL for LLMs, PyTorch-native.")
    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("alloc", help="explain an allocation-mode string such as 'sglang:d4t2+archon:d4p2t2'")
    p.add_argument("spec", help="allocation-mode string (quote it in the shell)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=_cmd_alloc)

    p = sub.add_parser("show-config", help="validate a config (YAML + key=value overrides) and print it resolved")
    add_config_arguments(p)
    p.add_argument("--keys", action="store_true", help="print the table of every key (type, default, meaning)")
    p.set_defaults(func=_cmd_show_config)

    p = sub.add_parser("convert-config", help="map an AReaL experiment config to a Tandem run config, key by key, "
                                              "and say what has no counterpart")
    p.add_argument("config", nargs="+", metavar="AREAL.yaml [key=value | +key=value ...]",
                   help="AReaL's YAML file, then Hydra-style overrides as AReaL takes them (+actor.archon.ac_debug=True)")
    p.add_argument("-o", "--output", metavar="OUT.yaml", default=None,
                   help="write the Tandem config here and the mapping to stdout (default: the config to stdout, the "
                        "mapping to stderr)")
    p.add_argument("--for", dest="for_command", choices=["train", "sft"], default="train",
                   help="the command whose loader must accept the result (default: train)")
    p.set_defaults(func=_cmd_convert_config)

    p = sub.add_parser("train", help="asynchronous RL: launch servers and trainers, train, sync weights, evaluate")
    add_config_arguments(p)
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("sft", help="supervised warm start on a task's reference completions; saves an HF model")
    add_config_arguments(p)
    p.set_defaults(func=_cmd_sft)

    p = sub.add_parser("init-model", help="write a randomly initialised HF-format model with a local tokenizer")
    p.add_argument("out_dir", help="directory to create")
    p.add_argument("--arch", choices=["qwen3", "qwen2", "qwen3_moe"], default="qwen3")
    p.add_argument("--preset", choices=["tiny", "small", "medium", "base"], default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None, help="transformer blocks (default: the preset's)")
    p.add_argument("--untied", action="store_true", help="a separate output head (default: tied to the embedding)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing non-empty directory")
    p.set_defaults(func=_cmd_init_model)

    p = sub.add_parser("export-merged", help="an HF model of a base with a PEFT LoRA adapter merged in")
    p.add_argument("base", help="the base HF model directory the adapter was trained on")
    p.add_argument("adapter", help="the PEFT adapter directory (adapter_config.json + adapter_model.safetensors)")
    p.add_argument("out_dir", help="directory to create")
    p.add_argument("--overwrite", action="store_true", help="replace an existing non-empty directory")
    p.set_defaults(func=_cmd_export_merged)

    p = sub.add_parser("model-info", help="load an HF model directory and summarise it")
    p.add_argument("path", help="HF model directory (config.json + safetensors)")
    p.set_defaults(func=_cmd_model_info)

    p = sub.add_parser("serve", help="run the inference server (SGLang-compatible HTTP protocol)")
    _add_serve_arguments(p)
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("sandbox", help="run untrusted code in the sandbox a code reward uses (docs/security.md)")
    sandbox = p.add_subparsers(dest="sandbox_command", required=True, metavar="SUBCOMMAND")
    p = sandbox.add_parser("run", help="run one Python program in the sandbox with rollout.sandbox's limits; print "
                                       "one JSON object: status, exit_code, stdout, stderr, reason, seconds",
                           description="Runs PROGRAM.py the way a code reward would and prints one JSON object "
                                       "(status, exit_code, stdout, stderr, reason, seconds). Exit code 0 for status "
                                       "ok, 1 for any other status, 2 when the sandbox is unavailable here.")
    p.add_argument("program", metavar="PROGRAM.py", help="the program (run by the system's /usr/bin/python3)")
    p.add_argument("--stdin", metavar="FILE", default=None, help="feed this file on the program's stdin")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="wall-clock and CPU seconds (rollout.sandbox.wall_s and cpu_s; default: theirs)")
    p.add_argument("--memory-mb", type=int, default=None, metavar="N",
                   help="memory in MiB (rollout.sandbox.memory_mb; default: its default)")
    p.set_defaults(func=_cmd_sandbox_run)

    p = sub.add_parser("fleet", help="the inference servers of a running `tandem train`: state, version, load")
    p.add_argument("run_dir", help="the run directory (it holds controller.json while the run goes on)")
    p.add_argument("--json", action="store_true", help="a JSON list of objects with keys address, pid, state, "
                                                       "version, in_flight, tokens_served, last_error")
    p.set_defaults(func=_cmd_fleet)

    p = sub.add_parser("dashboard", help="a live web page of a run (running or finished): fleet, step timeline, "
                                         "staleness, curves, trajectories (docs/dashboard.md)")
    p.add_argument("run_dir", help="the run directory (experiment.fileroot/experiment.name/experiment.trial)")
    p.add_argument("--port", type=int, default=8265, help="the port to serve on (default 8265)")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to bind (default loopback; another exposes the run to that network)")
    p.set_defaults(func=_cmd_dashboard)
    return parser


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """`CONFIG.yaml key.sub=value ...`, shared by every command that runs from a config."""
    parser.add_argument(
        "config",
        nargs="*",
        metavar="CONFIG.yaml | key=value",
        help="an optional YAML file first, then dotted overrides such as actor.optimizer.lr=1e-5",
    )


def config_from_args(args: argparse.Namespace, command: str = "train"):
    """The validated run config of `tandem <command>` (train or sft): schema checks
    (`load_run_config`), then the flags given to launched servers (`rollout.server_args`), which
    only this module's `serve` parser knows."""
    from tandem.rl.config import load_run_config  # OmegaConf and every schema: ~0.4 s

    items = list(args.config)
    path = items.pop(0) if items and "=" not in items[0] else None
    cfg = load_run_config(path, items, command)
    check_server_args(cfg.rollout.server_args, "rollout.server_args")
    return cfg


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit
        raise ConfigError(message)


def check_server_args(server_args: Sequence[str], key: str) -> None:
    """`server_args` parse as `tandem serve` flags and leave the launcher's own flags alone."""
    for arg in server_args:
        flag = str(arg).split("=", 1)[0]
        if flag in LAUNCHER_FLAGS:
            raise ConfigError(f"{key}: {flag} is set by the launcher for every server; set it through "
                              f"{LAUNCHER_FLAGS[flag]} instead and remove it from {key}")
    parser = _RaisingParser(prog="tandem serve", add_help=False)
    _add_serve_arguments(parser)
    try:
        parser.parse_args(["--model", "-", *map(str, server_args)])
    except ConfigError as exc:
        raise ConfigError(f"{key}: {exc} (the options of `tandem serve --help`)") from None


def require_model_path(cfg) -> None:
    if not cfg.actor.path:
        raise ConfigError("actor.path is not set: pass the model to train, e.g. actor.path=runs/base (an HF "
                          "directory; `tandem init-model DIR` makes a small one)")


def _cmd_alloc(args: argparse.Namespace) -> int:
    mode = parse_allocation(args.spec)
    print(json.dumps(mode.to_json(), indent=2) if args.json else mode.explain())
    return 0


def _cmd_show_config(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if args.keys:
        print(keys_markdown(type(cfg), cfg))
    else:
        print(to_yaml(cfg), end="")
    return 0


def _cmd_convert_config(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    import yaml

    from tandem.config.areal import convert, read_areal  # OmegaConf, which --help and alloc never need
    from tandem.rl.config import load_run_config  # OmegaConf and every schema: ~0.4 s

    source, *overrides = args.config
    conversion = convert(read_areal(source, overrides))
    report = conversion.report()
    model = str(conversion.tandem.get("actor", {}).get("path") or "")
    check_overrides = []
    if model and not Path(model).is_dir():  # a Hub id, most often: Tandem loads local directories
        check_overrides = ["actor.path=''"]
        report += (f"\nNote: actor.path {model!r} is not a directory here; Tandem loads a local HF directory: "
                   f"download it (e.g. `huggingface-cli download {model} --local-dir DIR`) and run with "
                   "actor.path=DIR (the load check here leaves actor.path out)")
    text = (f"# Converted by `tandem convert-config` from the AReaL config {source}"
            + "".join(f" {o}" for o in overrides) + "\n" + "".join(f"# {line}\n" for line in report.splitlines())
            + yaml.safe_dump(conversion.tandem, sort_keys=False))
    out = sys.stdout if args.output is None else sys.stderr
    print(report, file=sys.stderr if args.output is None else sys.stdout)
    with tempfile.TemporaryDirectory() as tmp:  # what `tandem <command> OUT.yaml` will load
        probe = Path(tmp) / "converted.yaml"
        probe.write_text(text)
        try:
            load_run_config(probe, check_overrides, args.for_command)
        except ConfigError as exc:
            raise ConfigError(f"the converted config does not load for tandem {args.for_command} (nothing written): "
                              f"{exc}") from None
    if args.output is None:
        print(text, end="", file=out)
    else:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}; it loads for tandem {args.for_command}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    if not args.config:
        print(TRAIN_USAGE, end="", file=sys.stderr)
        return EXIT_USAGE
    cfg = config_from_args(args)
    require_model_path(cfg)
    from tandem.rl.evaluate import check_sandbox
    from tandem.rl.trial import plan_trial, relaunch_plan  # the run config: ~0.4 s

    check_sandbox(cfg)  # a reward that runs code, where the sandbox cannot run: before any launch

    plan = plan_trial(cfg)  # refuses at once a launch that would mix or discard runs
    setup_console()
    print(f"tandem train: run directory {plan.run_dir}: {plan.describe()}; controller log "
          f"{plan.run_dir / 'logs' / CONTROLLER_LOG}", file=sys.stderr, flush=True)
    with interrupts_held():
        from tandem.rl.trainer import RunInterrupted, run_rl  # torch, transformers: seconds

    for attempt in range(cfg.recover.retries + 1):
        try:
            summary = run_rl(cfg, plan)
            break
        except RunInterrupted as exc:
            print(f"tandem train: {exc}", file=sys.stderr)
            return EXIT_INTERRUPTED
        except Exception as exc:
            if attempt == cfg.recover.retries or isinstance(exc, ConfigError):
                raise
            plan = relaunch_plan(cfg)
            print(f"tandem train: the run failed ({type(exc).__name__}: {str(exc)[:500]}); relaunching it "
                  f"(recover.retries: {attempt + 1} of {cfg.recover.retries}), {plan.describe()}",
                  file=sys.stderr, flush=True)
    print(summary.describe())
    return 0


def _cmd_sft(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, "sft")
    require_model_path(cfg)

    setup_console()
    with interrupts_held():  # torch, transformers: seconds
        if cfg.sft.objective == "reward":
            from tandem.rl.reward_sft import run_reward_sft as run
        else:
            from tandem.rl.sft import run_sft as run

    out, result = run(cfg)
    if "eval/reward_accuracy" in result:  # sft.objective=reward
        evaluated = (f"held-out pairs: accuracy {result['eval/reward_accuracy']:.3f}, "
                     f"loss {result['eval/reward_loss']:.3f}")
    else:
        evaluated = f"eval accuracy {result['eval/accuracy']:.3f}" if "eval/accuracy" in result else "not evaluated"
    print(f"SFT model written to {out}; {evaluated}")
    return 0


def _cmd_init_model(args: argparse.Namespace) -> int:
    from tandem.models.tiny import init_model  # torch, tokenizers: ~1 s

    overrides: dict[str, int | bool] = {}
    if args.layers is not None:
        if args.layers < 1:
            raise ConfigError(f"--layers must be at least 1, got {args.layers}")
        overrides["num_hidden_layers"] = args.layers
    if args.untied:
        overrides["tie_word_embeddings"] = False
    out = init_model(args.out_dir, arch=args.arch, preset=args.preset, seed=args.seed, overwrite=args.overwrite,
                     overrides=overrides)
    shape = "".join(f", {k}={v}" for k, v in overrides.items())
    print(f"wrote {args.arch} preset {args.preset!r} (seed {args.seed}{shape}) to {out}")
    return 0


def _cmd_export_merged(args: argparse.Namespace) -> int:
    from tandem.models.lora_export import export_merged

    out = export_merged(args.base, args.adapter, args.out_dir, overwrite=args.overwrite)
    print(f"merged {args.adapter} into {args.base}: {out}")
    return 0


def _cmd_model_info(args: argparse.Namespace) -> int:
    from tandem.models import load_model  # torch: ~1 s

    model = load_model(args.path)
    n_params = sum(p.numel() for p in model.parameters())
    a = model.args
    print(f"{args.path}: {model.hf_config.get('model_type')} with {n_params:,} parameters")
    print(
        f"  layers {a.n_layers}, dim {a.dim}, heads {a.n_heads} (kv {a.n_kv_heads}, head_dim {a.head_dim}), "
        f"ffn {a.intermediate_size}, vocab {a.vocab_size}, tied embeddings {a.tie_word_embeddings}"
    )
    return 0


def _add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "--model-path", dest="model_path", required=True, help="HF model directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--host-towards", default=None, metavar="ADDR",
                   help="bind this host's address on the interface that routes to ADDR (overrides --host): how "
                        "a scheduler that places the server on some node has it listen where the controller "
                        "reaches it")
    p.add_argument("--port", type=int, default=30000, help="port; 0 picks a free one (printed on startup)")
    p.add_argument("--api-key", default=os.environ.get(ENV_SERVE_API_KEY) or None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: "
                        f"${ENV_SERVE_API_KEY}, which keeps the key off the command line other users can read)")
    p.add_argument("--served-model-name", default=None, help="model name of the OpenAI routes (default: the path)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one running batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget of one prefill step")
    p.add_argument("--kv-cache-tokens", type=int, default=32768, help="KV cache capacity in tokens")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="float32")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--seed", type=int, default=0, help="seeds the draws of requests that bring no seed")
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="a sequence's logits do not depend on what else is in the batch (prefill attention per "
                        "sequence, no shared-prefix decode passes): bit-identical reruns under any batching")
    p.add_argument("--allocator", choices=["tcmalloc", "system"], default="tcmalloc",
                   help="tcmalloc (default; glibc's malloc where it is not installed, logged) or system: large "
                        "batches reuse their memory instead of faulting it in each step")
    p.add_argument("--weight-sync-timeout", type=float, default=120.0,
                   help="seconds to form a weight-update group or receive one tensor over it")
    p.add_argument("--weights-dir", action="append", default=[], metavar="DIR",
                   help="/update_weights_from_disk may load from DIR and below (repeatable); the --model "
                        "directory always; any other path is refused (403)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--is-embedding", action="store_true",
                   help="serve a sequence classifier (a reward model: ...ForSequenceClassification, or a value model "
                        "...ForTokenClassification with one label) on /classify and /v1/classify instead of generating "
                        "(SGLang's flag; docs/rewards.md)")
    p.add_argument("--join", default=None, metavar="RUN_DIR",
                   help="join the running `tandem train` of RUN_DIR (its controller.json): the run warms this "
                        "server to its current weights and gives it traffic (docs/fleet.md)")


def _cmd_sandbox_run(args: argparse.Namespace) -> int:
    """Exit 0 when the program ran and exited 0 (status ok), 1 for any other status."""
    from pathlib import Path

    from tandem.config.fields import validate
    from tandem.sandbox import SandboxConfig, run

    config = SandboxConfig()
    if args.timeout is not None:
        config.wall_s = config.cpu_s = args.timeout
    if args.memory_mb is not None:
        config.memory_mb = args.memory_mb
    try:
        validate(config, prefix="rollout.sandbox.")
    except ConfigError as exc:
        raise ConfigError(f"{exc} (--timeout sets wall_s and cpu_s, --memory-mb sets memory_mb)") from None
    program = Path(args.program)
    if not program.is_file():
        raise ConfigError(f"{program}: no such file (PROGRAM.py is the Python program to run)")
    stdin = None
    if args.stdin is not None:
        if not Path(args.stdin).is_file():
            raise ConfigError(f"--stdin {args.stdin}: no such file")
        stdin = Path(args.stdin).read_bytes()
    execution = run(program, stdin, config)
    fields = ("status", "exit_code", "stdout", "stderr", "reason", "seconds")
    print(json.dumps({k: execution.to_json()[k] for k in fields}))
    return 0 if execution.ok else 1


FLEET_KEYS = ("address", "pid", "state", "version", "in_flight", "tokens_served", "last_error")


def _cmd_dashboard(args: argparse.Namespace) -> int:
    from tandem.dashboard.app import serve  # FastAPI: under a second

    serve(args.run_dir, host=args.host, port=args.port)
    return 0


def _cmd_fleet(args: argparse.Namespace) -> int:
    members = ControllerClient(read_controller_file(args.run_dir)).members()
    servers = [{k: s.get(k) for k in FLEET_KEYS} for s in members["servers"]]
    if args.json:
        print(json.dumps(servers, indent=2))
        return 0
    print(f"group generation {members.get('generation')}, fleet at weight version {members.get('version')}, "
          f"{sum(s['state'] == 'healthy' for s in servers)} of {len(servers)} server(s) healthy")
    rows = [["ADDRESS", "PID", "STATE", "VERSION", "IN FLIGHT", "TOKENS", "LAST ERROR"]]
    for s in servers:
        error = str(s["last_error"] or "")
        rows.append([str(s["address"]), "-" if s["pid"] is None else str(s["pid"]), str(s["state"]),
                     "-" if s["version"] is None else str(s["version"]), str(s["in_flight"]),
                     str(s["tokens_served"]), error if len(error) <= 60 else error[:57] + "..."])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    reexec_with_allocator(args.allocator)  # before torch: tcmalloc must be loaded at process start
    from tandem.inference.server import ServerArgs, serve  # torch, the engine: ~1.5 s

    if args.host_towards:  # a scheduler on another host: bind the address the controller reaches
        from tandem.net import address_towards  # torch (TCPStore): ~1 s

        args.host = address_towards(args.host_towards)
    return serve(ServerArgs.from_namespace(args))


if __name__ == "__main__":
    sys.exit(main())
