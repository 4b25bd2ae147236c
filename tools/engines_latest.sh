#!/usr/bin/env bash
# make engines-latest: what a maintainer runs the day vLLM or SGLang releases.
# For each engine: the newest release the registry serves, a venv of it built by the engine
# tier's own recipe (COMPAT_DIR, cached), the tier's tests run there, and the plugin's seams
# probed (tools/engine_seams.py prints which moved). Ends with one line per engine.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-python3}
MAKE=${MAKE:-make}
COMPAT_DIR=${COMPAT_DIR:-$HOME/.cache/compile_pass}
summary=()

newest() {  # the newest release of $1 on the registry
  PIP_CONSTRAINT=/dev/null "$PY" -m pip index versions "$1" 2>/dev/null | sed -n "s/^$1 (\(.*\))\$/\1/p"
}

pin_of() {  # the version $2 pins of project $3, read from the wheel of $1==$2
  local d; d=$(mktemp -d)
  PIP_CONSTRAINT=/dev/null "$PY" -m pip download -q --no-deps "$1==$2" -d "$d" >/dev/null 2>&1 || return 1
  "$PY" -m tools.requirements_of "$1" --wheel "$d"/*.whl --only "$3" | sed -n 's/^[^=]*==\([^ ;]*\).*/\1/p'
  rm -rf "$d"
}

v=$(newest vllm)
if [ -z "$v" ]; then summary+=("vllm: the registry did not answer"); else
  echo "== vllm $v (newest on the registry)"
  COMPILE_PASS_VLLM_UNTESTED=1 "$MAKE" --no-print-directory "vllm-$v"; tier=$?
  "$COMPAT_DIR/venv-vllm$v/bin/python" -m tools.engine_seams vllm 2>/dev/null | tee /tmp/engines-latest-vllm.txt
  summary+=("vllm $v: tier $( [ $tier = 0 ] && echo passed || echo FAILED ); $(tail -n 1 /tmp/engines-latest-vllm.txt)")
fi

s=$(newest sglang)
if [ -z "$s" ]; then summary+=("sglang: the registry did not answer"); else
  t=$(pin_of sglang "$s" torch)
  echo "== sglang $s (newest on the registry; pins torch ${t:-?})"
  "$MAKE" --no-print-directory sglang SGLANG_VERSION="$s" SGLANG_TORCH="${t:-2.14.1}"; tier=$?
  "$COMPAT_DIR/venv-sglang$s/bin/python" -m tools.engine_seams sglang 2>/dev/null | tee /tmp/engines-latest-sglang.txt
  summary+=("sglang $s: tier $( [ $tier = 0 ] && echo passed || echo FAILED ); $(tail -n 1 /tmp/engines-latest-sglang.txt)")
fi

echo "== engines-latest"
printf '%s\n' "${summary[@]}"
