# Two commands do all the set-up on a fresh machine:
#   make train   create .venv, install dptrain, train the reference CNN (GPU if present, else CPU)
#   make test    create .venv, install dptrain with its test tools, run the tests
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CUDA extra only where a GPU driver is visible.
EXTRAS := test$(shell command -v nvidia-smi >/dev/null 2>&1 && echo ",cuda")

.PHONY: train test venv clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $@

# The venv's bin first: mpirun from the bundled Open MPI lives there.
RUN := PATH="$(abspath $(VENV))/bin:$$PATH"

train: venv
	$(RUN) $(PY) -m dptrain train --log-dir runs/latest --save runs/latest/weights.npz

test: venv
	$(RUN) $(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
