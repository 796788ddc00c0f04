# Sourced (`. index-env.sh`) by the Dockerfiles' RUN steps that install packages: the build args INDEX_URL,
# EXTRA_INDEX_URL, FIND_LINKS, TORCH_INDEX_URL, PYTHON_INSTALL_MIRROR and the BuildKit secrets `ca_bundle` and
# `netrc` become pip's and uv's settings; an empty or absent one leaves the tool's default. POSIX sh (dash).
# Secrets are mounted at /run/secrets/<id> for one RUN only: nothing here ends up in a layer.
if [ -s /run/secrets/ca_bundle ]; then
    # uv and pip verify TLS with this bundle instead of their built-in roots (a corporate CA, a TLS proxy).
    export SSL_CERT_FILE=/run/secrets/ca_bundle PIP_CERT=/run/secrets/ca_bundle REQUESTS_CA_BUNDLE=/run/secrets/ca_bundle
fi
if [ -s /run/secrets/netrc ]; then
    export NETRC=/run/secrets/netrc  # index credentials (uv and pip read it)
fi
if [ -n "${INDEX_URL:-}" ]; then
    export UV_INDEX_URL="$INDEX_URL" PIP_INDEX_URL="$INDEX_URL"
fi
if [ -n "${EXTRA_INDEX_URL:-}" ]; then
    export UV_EXTRA_INDEX_URL="$EXTRA_INDEX_URL" PIP_EXTRA_INDEX_URL="$EXTRA_INDEX_URL"  # space-separated
fi
# Wheel locations: FIND_LINKS (space-separated) and the build context's deploy/docker/wheels/ (bind-mounted at
# /wheels; OPSD_WHEELS only for tests/test_image_build.py).
opsd_wheels="${OPSD_WHEELS:-/wheels}"
opsd_links="${FIND_LINKS:-}"
if ls "$opsd_wheels"/*.whl >/dev/null 2>&1; then
    opsd_links="$opsd_wheels${opsd_links:+ $opsd_links}"
fi
if [ -n "$opsd_links" ]; then
    export PIP_FIND_LINKS="$opsd_links"
    UV_FIND_LINKS=$(printf '%s' "$opsd_links" | tr -s ' ' ',')  # uv wants them comma-separated
    export UV_FIND_LINKS
fi
if [ -n "${PYTHON_INSTALL_MIRROR:-}" ]; then
    export UV_PYTHON_INSTALL_MIRROR="$PYTHON_INSTALL_MIRROR"
fi

# opsd_install_cpu_torch REQUIREMENT: the CPU build of torch, never PyPI's (a CUDA build of several GB).
# A torch wheel in /wheels: from there alone (no index); else from TORCH_INDEX_URL (default the PyTorch CPU
# index) plus the wheel locations; TORCH_INDEX_URL=none: from the wheel locations alone.
opsd_install_cpu_torch() {
    # Without an index, torch alone (--no-deps): its dependencies (filelock, sympy, ...) come from the package
    # index with the requirements that follow, which find torch==2.13.0 met by the installed 2.13.0+cpu.
    if ls "$opsd_wheels"/torch-*.whl >/dev/null 2>&1; then
        echo "index-env: $1 from the build context's deploy/docker/wheels/ (no index)"
        uv pip install --no-index --no-deps --find-links "$opsd_wheels" "$1"
    elif [ "${TORCH_INDEX_URL:-none}" = none ]; then
        echo "index-env: $1 from FIND_LINKS only (TORCH_INDEX_URL=none)"
        uv pip install --no-index --no-deps "$1"
    else
        echo "index-env: $1 from $TORCH_INDEX_URL"
        uv pip install --index-url "$TORCH_INDEX_URL" "$1"
    fi
}
