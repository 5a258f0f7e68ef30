"""Parse SGLang launch commands with SGLang's own parser; run by an interpreter that can import sglang.

A script, not a module of the package: it runs under SGLang's interpreter (`sglang.python`), which need not
have this package, so it imports only the standard library and sglang. stdin: a JSON list of commands
(`python -m sglang.launch_server ARGS...` or bare ARGS); stdout: one JSON object,
{"version": sglang's version, "results": [{"ok": bool, "error": str}, ...]} in the same order.

The parser is the one `sglang serve` / `launch_server` builds (`sglang/srt/server_args.py:668-696`:
`argparse.ArgumentParser` + `ServerArgs.add_cli_args`); only the argparse step runs, since building a
`ServerArgs` inspects the GPUs. An unknown, ambiguous or mistyped flag is an error, as at launch.
"""

from __future__ import annotations

import argparse
import json
import sys

LAUNCH_MODULE = ("-m", "sglang.launch_server")


class _Refused(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit 2; we report the message instead
        raise _Refused(message)


def _server_args(command: list[str]) -> list[str]:
    for i in range(len(command) - 1):
        if tuple(command[i:i + 2]) == LAUNCH_MODULE:
            return command[i + 2:]
    return command


def check(commands: list[list[str]]) -> dict:
    import sglang
    from sglang.srt.server_args import ServerArgs

    results = []
    for command in commands:
        parser = _Parser(prog="sglang serve")
        ServerArgs.add_cli_args(parser)
        try:
            parser.parse_args(_server_args(command))
            results.append({"ok": True, "error": ""})
        except _Refused as e:
            results.append({"ok": False, "error": str(e)})
    return {"version": getattr(sglang, "__version__", "?"), "results": results}


if __name__ == "__main__":
    json.dump(check(json.load(sys.stdin)), sys.stdout)
