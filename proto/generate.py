"""Generate the Python gRPC stubs under otel_dra/_generated from the .proto files in proto/.

``python proto/generate.py`` (``make protos``) writes into the repository; ``--out DIR`` writes
elsewhere (tests/unit/test_protos.py regenerates into a temporary directory and compares). The
package ``__init__.py`` files are handwritten and not touched.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REPO = PROTO_ROOT.parent


def proto_files() -> list[str]:
    return sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))


def generate(out: Path) -> None:
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    files = proto_files()
    # gRPC stubs only for the files that define a service: for the others (the trimmed Kubernetes
    # messages) protoc would write a _pb2_grpc.py with nothing in it.
    with_services = [f for f in files if re.search(r"^service ", (PROTO_ROOT / f).read_text(), re.M)]
    for outputs, selected in (
        ([f"--python_out={out}", f"--pyi_out={out}"], files),
        ([f"--grpc_python_out={out}"], with_services),
    ):
        code = protoc.main(["grpc_tools.protoc", f"-I{PROTO_ROOT}", *outputs, *selected])
        if code != 0:
            raise SystemExit(f"protoc failed with exit code {code}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=REPO, help="output root (default: the repository)")
    generate(parser.parse_args().out)


if __name__ == "__main__":
    sys.exit(main())
