# Source on the device machine from the repository root: installs carried wheels (.whl/) and makes
# `parastream.*` importable from this checkout without building it.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
mkdir -p /tmp/ns/parastream
for d in launcher pipeline rewrite; do ln -sfn "$PWD/$d" /tmp/ns/parastream/$d; done
export PYTHONPATH=/tmp/ns:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
