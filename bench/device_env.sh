# Source on the device machine from the repository root: installs carried wheels (.whl/) and makes
# `parastream.*` importable from this checkout without building it.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
# wheels carried as their installed tree in an xz tar (bench/triton_wheels.sh: nvidia-pytriton's, too large as a zip)
for t in .whl/*.tar.xz; do [ -f "$t" ] && { tar -C /tmp/site -xJf "$t" || return 1; }; done
mkdir -p /tmp/ns/parastream
for d in core launcher pipeline rewrite; do ln -sfn "$PWD/$d" /tmp/ns/parastream/$d; done
export PYTHONPATH=/tmp/ns:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
# The device's Python runs with PYTHONDONTWRITEBYTECODE and its torch tree holds no .pyc files: every fresh process
# compiled 1436 modules from source (6.1 s of a profiled 100-engine load), which a pip-installed torch never
# does. Compiled modules are written, to a prefix of their own, as an install would have written them.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/pycache
# Interpreters that ignore PYTHONPATH (Triton's Python backend stub embeds this Python in isolated mode: model.py
# found no parastream) see the same folders through a .pth file in this interpreter's site-packages; the same file
# gives them the .pyc prefix (isolated mode ignores PYTHONPYCACHEPREFIX: a stub compiled torch from source, and a
# model.py initialize took 16.6 s where the same load in a benchmark process took 4.4 s).
site_dir=$(python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null) && [ -w "$site_dir" ] && \
    printf '/tmp/ns\n/tmp/site\nimport sys; sys.pycache_prefix = sys.pycache_prefix or "/tmp/pycache"\n' \
        > "$site_dir/zz_parastream_device.pth"
