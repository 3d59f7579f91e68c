# Sourced by the setup_venv.sh scripts: make_venv PYTHON VENV WANTED creates VENV with PYTHON
# unless it already has an interpreter; WANTED names the Python the caller needs (for the error).
make_venv() {
    local python=$1 venv=$2 wanted=$3
    if ! command -v "$python" >/dev/null; then
        echo "setup_venv.sh: $python not found; set PYTHON to a $wanted interpreter" >&2
        exit 2
    fi
    if [ ! -x "$venv/bin/python" ]; then
        echo "creating $venv with $python"
        "$python" -m venv "$venv"
    fi
}
