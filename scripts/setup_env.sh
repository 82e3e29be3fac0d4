#!/usr/bin/env bash
# Create and fill the project's virtual environment .venv (idempotent).
#
#   bash scripts/setup_env.sh        # the make targets call it for you
#
# A stamp file (.venv/.moetier-setup) holds a hash of pyproject.toml, this
# script, the repo path and MOETIER_USE_SYSTEM_TORCH; when it matches, the
# script only checks that .venv still runs and exits (well under 2 s).
#
# Torch policy (torch is installed BEFORE the package, so that pip finds the
# package's `torch>=2.4` already satisfied and installs nothing more for it):
#   1. An importable torch is kept, whatever its build: one already in .venv,
#      or, with MOETIER_USE_SYSTEM_TORCH=1, the system Python's (the venv is
#      then made with --system-site-packages). A user's CUDA torch survives.
#   2. Otherwise, if `nvidia-smi -L` lists a GPU: pip's default torch (CUDA).
#   3. Otherwise a CPU build: `torch==2.13.0`. Before installing, a pip dry
#      run checks that the spec does not resolve to a CUDA build (multi-GB);
#      if it does, the script stops and asks for MOETIER_TORCH_PIP_ARGS.
#   After `pip install -e '.[dev]'` it checks that torch.__version__ did not
#   change, and fails if a CUDA build was installed on a machine without GPU.
#
# Environment:
#   PYTHON                    interpreter that makes the venv (default python3, >= 3.11)
#   MOETIER_USE_SYSTEM_TORCH  1: use the system Python's torch (--system-site-packages)
#   MOETIER_TORCH_SPEC        pip requirement for torch when none is importable,
#                             e.g. 'torch==2.9.1' (default: see policy above)
#   MOETIER_TORCH_PIP_ARGS    extra pip options for the torch install only, split
#                             on spaces; e.g. '--index-url URL' with the URL of
#                             PyTorch's CPU wheel index (pytorch.org lists it) to
#                             get a CPU build on Linux where PyPI serves CUDA ones
# To start over (or switch MOETIER_USE_SYSTEM_TORCH): `make clean` or rm -rf .venv.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
VPY="$VENV/bin/python"
STAMP="$VENV/.moetier-setup"
PYTHON="${PYTHON:-python3}"
USE_SYSTEM_TORCH="${MOETIER_USE_SYSTEM_TORCH:-0}"
CPU_TORCH_SPEC="torch==2.13.0"
GPU_TORCH_SPEC="torch>=2.4"
T0=$SECONDS

say() { echo "setup: $*"; }
die() { echo "setup: ERROR: $*" >&2; exit 1; }
trap 'echo "setup: ERROR: failed at line $LINENO: $BASH_COMMAND" >&2' ERR

command -v "$PYTHON" >/dev/null 2>&1 \
  || die "'$PYTHON' not found; install Python >= 3.11 or set PYTHON=/path/to/python3"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || die "moetier needs Python >= 3.11; '$PYTHON' is $("$PYTHON" -V 2>&1); set PYTHON=..."
case "$USE_SYSTEM_TORCH" in 0|1) ;; *) die "MOETIER_USE_SYSTEM_TORCH must be 0 or 1, not '$USE_SYSTEM_TORCH'";; esac

KEY="$("$PYTHON" - "$ROOT" "$USE_SYSTEM_TORCH" <<'EOF'
import hashlib, sys
h = hashlib.sha256()
for name in ("pyproject.toml", "scripts/setup_env.sh"):
    with open(name, "rb") as f:
        h.update(f.read())
h.update(("\0".join(sys.argv[1:])).encode())
print(h.hexdigest())
EOF
)"

is_fresh() { [[ -f "$STAMP" && "$(cat "$STAMP")" == "$KEY" ]] && "$VPY" -c '' 2>/dev/null; }

if is_fresh; then
  touch "$STAMP"   # make compares the stamp's mtime with pyproject.toml's
  say ".venv is up to date"
  exit 0
fi

# Two setups at once (say two make runs) would race in one venv: serialise.
if command -v flock >/dev/null 2>&1; then
  exec 9>"$ROOT/.venv.lock"
  flock 9
  if is_fresh; then say ".venv is up to date (set up by a concurrent run)"; exit 0; fi
fi
rm -f "$STAMP"

# --- 1. the venv ------------------------------------------------------------
if [[ -e "$VENV" ]] && ! "$VPY" -c '' 2>/dev/null; then
  say "removing broken .venv (its python does not run)"
  rm -rf "$VENV"
fi
if [[ -d "$VENV" ]]; then
  has_sys="$(sed -n 's/^include-system-site-packages *= *//p' "$VENV/pyvenv.cfg")"
  want_sys=false; [[ "$USE_SYSTEM_TORCH" == 1 ]] && want_sys=true
  [[ "$has_sys" == "$want_sys" ]] || die ".venv has include-system-site-packages=$has_sys but \
MOETIER_USE_SYSTEM_TORCH=$USE_SYSTEM_TORCH asks for $want_sys; remove .venv (make clean) to switch"
  say "reusing .venv ($("$VPY" -V 2>&1))"
else
  venv_args=()
  [[ "$USE_SYSTEM_TORCH" == 1 ]] && venv_args+=(--system-site-packages)
  say "creating .venv with $("$PYTHON" -V 2>&1)$([[ $USE_SYSTEM_TORCH == 1 ]] && echo " (--system-site-packages)")"
  "$PYTHON" -m venv ${venv_args[@]+"${venv_args[@]}"} "$VENV" \
    || die "'$PYTHON -m venv' failed (on Debian/Ubuntu: apt-get install python3-venv)"
fi
# pip, quiet; some pip configs list local indexes that lack most projects and
# pip warns once per such project: drop those lines, keep everything else.
pip_q() {
  "$VPY" -m pip --disable-pip-version-check "$@" -q 2>&1 | { grep -v "^WARNING: Location 'file:" || true; }
  return "${PIPESTATUS[0]}"
}

# --- 2. torch -----------------------------------------------------------------
# Prints "version cuda-version-or-cpu location" of the importable torch, or fails.
torch_info() {
  "$VPY" -c 'import torch; print(torch.__version__, torch.version.cuda or "cpu", torch.__file__)' 2>/dev/null
}
# Asks nvidia-smi once; its output is captured whole (grep -q in a pipe could
# cut nvidia-smi off with SIGPIPE, which pipefail would report as "no GPU").
GPU_SEEN=""
has_gpu() {
  if [[ -z "$GPU_SEEN" ]]; then
    GPU_SEEN=no
    if command -v nvidia-smi >/dev/null 2>&1; then
      grep -q '^GPU ' <<<"$(nvidia-smi -L 2>/dev/null || true)" && GPU_SEEN=yes
    fi
  fi
  [[ "$GPU_SEEN" == yes ]]
}

installed_torch=0
if info="$(torch_info)"; then
  read -r tver tcuda tfile <<<"$info"
  where=venv; [[ "$tfile" == "$VENV"/* ]] || where=system
  say "keeping torch $tver ($([[ $tcuda == cpu ]] && echo 'CPU build' || echo "CUDA $tcuda")) from the $where site-packages"
  if [[ "$tcuda" != cpu ]] && ! has_gpu; then
    say "note: this torch is a CUDA build but nvidia-smi lists no GPU"
  fi
else
  read -r -a torch_pip_args <<<"${MOETIER_TORCH_PIP_ARGS:-}"
  if has_gpu; then
    spec="${MOETIER_TORCH_SPEC:-$GPU_TORCH_SPEC}"
    say "GPU found (nvidia-smi -L): installing $spec${MOETIER_TORCH_PIP_ARGS:+ $MOETIER_TORCH_PIP_ARGS}"
  else
    spec="${MOETIER_TORCH_SPEC:-$CPU_TORCH_SPEC}"
    say "no GPU (nvidia-smi lists none): checking that $spec${MOETIER_TORCH_PIP_ARGS:+ $MOETIER_TORCH_PIP_ARGS} resolves to a CPU build"
    report="$(mktemp)"
    pip_q install --dry-run --report "$report" ${torch_pip_args[@]+"${torch_pip_args[@]}"} "$spec" \
      || die "pip could not resolve '$spec'; set MOETIER_TORCH_SPEC / MOETIER_TORCH_PIP_ARGS"
    cuda_sign="$("$VPY" - "$report" <<'EOF'
import json, sys
items = json.load(open(sys.argv[1])).get("install", [])
names = [i["metadata"]["name"].lower() for i in items]
torch_versions = [i["metadata"]["version"] for i in items if i["metadata"]["name"].lower() == "torch"]
signs = [n for n in names if n.startswith(("nvidia-", "cuda-")) or n == "triton"]
signs += [f"torch {v}" for v in torch_versions if "+cu" in v]
print(" ".join(sorted(set(signs))))
EOF
)"
    rm -f "$report"
    [[ -z "$cuda_sign" ]] || die "'$spec' resolves to a CUDA build here (it pulls: $cuda_sign), \
several GB that this machine without a GPU cannot use. Point pip at CPU wheels, e.g. \
MOETIER_TORCH_PIP_ARGS='--index-url <PyTorch CPU wheel index>', or pin one with MOETIER_TORCH_SPEC."
    say "installing $spec (CPU build)"
  fi
  pip_q install ${torch_pip_args[@]+"${torch_pip_args[@]}"} "$spec" \
    || die "pip install '$spec' failed; set MOETIER_TORCH_SPEC / MOETIER_TORCH_PIP_ARGS"
  info="$(torch_info)" || die "torch was installed but does not import: $("$VPY" -c 'import torch' 2>&1 | tail -1)"
  read -r tver tcuda tfile <<<"$info"
  installed_torch=1
fi

# --- 3. the package (editable) with the dev extras -------------------------
# The constraint pins torch to what is there, so pip can never swap it.
say "installing moetier (editable) with extras [dev]"
constraints="$(mktemp)"
echo "torch==$tver" >"$constraints"
pip_q install -c "$constraints" -e '.[dev]' \
  || { rm -f "$constraints"; die "pip install -e '.[dev]' failed (see pip's message above)"; }
rm -f "$constraints"

# --- 4. checks ----------------------------------------------------------------
info="$(torch_info)" || die "torch no longer imports after installing moetier"
read -r tver2 tcuda2 _ <<<"$info"
[[ "$tver2" == "$tver" ]] || die "torch changed from $tver to $tver2 while installing moetier"
if [[ "$installed_torch" == 1 && "$tcuda" != cpu ]] && ! has_gpu; then
  die "a CUDA build of torch ($tver, CUDA $tcuda) was installed on a machine without a GPU; \
remove .venv and set MOETIER_TORCH_SPEC / MOETIER_TORCH_PIP_ARGS to get a CPU build"
fi
"$VPY" -c 'import moetier' || die "moetier does not import from .venv"

echo "$KEY" >"$STAMP"
say "done in $((SECONDS - T0)) s: torch $tver ($([[ $tcuda == cpu ]] && echo CPU || echo "CUDA $tcuda")), python $("$VPY" -c 'import sys; print(sys.version.split()[0])')"
