"""``python -m sglang.launch_server`` for tests: the SGLang stub with SGLang's launch flags.

Needs ``tests/engine`` on PYTHONPATH (for the ``stubs`` package); unknown flags are ignored.
"""

import argparse
from pathlib import Path

from stubs.sglang_stub import SGLangStub

parser = argparse.ArgumentParser()
parser.add_argument("--model-path", required=True)
parser.add_argument("--host", default="127.0.0.1")
parser.add_argument("--port", type=int, default=30000)
parser.add_argument("--weight-version", default="default")
parser.add_argument("--api-key", default=None)
args, _ = parser.parse_known_args()
print(f"stub SGLang server on {args.host}:{args.port}", flush=True)
SGLangStub(
    Path(args.model_path),
    weight_version=args.weight_version,
    api_key=args.api_key,
    host=args.host,
    port=args.port,
).serve_forever()
