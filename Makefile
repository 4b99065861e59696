VENV := .venv
PY := $(VENV)/bin/python
LAUNCH := $(PY) -m tpflow.launch
# A GPU machine's own python (torch, triton, pytest; no venv), run from the repository on compiled kernels
GPU_PY ?= python
GPU_RUN := env -u TRITON_INTERPRET PYTHONPATH=. $(GPU_PY)

.PHONY: test lint demo examples gpu-check gpu-tests gpu-kernels gpu-grouped gpu-loss gpu-decode clean

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test]"
	touch $@

test: $(VENV)/.installed
	$(PY) -m pytest -q --durations=40  # the slowest tests, named in CI's log (its budget is 15 minutes)

# ruff's checks as pyproject.toml configures them (.ci/run runs this before the tests)
lint: $(VENV)/.installed
	$(PY) -m ruff check .

# Every parallel mode side by side on the default workloads (CPU processes over gloo when there is no GPU),
# then the plot of those rows.
demo: $(VENV)/.installed
	$(PY) -m tpflow.bench --nproc_per_node 2
	$(PY) -m tpflow.bench.plot

# The seed scenarios through the launcher, and a Hugging Face model fine-tuned by its own plan.
examples: $(VENV)/.installed
	$(LAUNCH) --nproc_per_node 2 examples/data_parallel.py
	$(LAUNCH) --nproc_per_node 2 examples/model_parallel.py
	$(LAUNCH) --nproc_per_node 2 examples/pipeline_two_stage.py
	$(LAUNCH) --nproc_per_node 4 examples/hybrid_module_model.py
	$(LAUNCH) --nproc_per_node 2 examples/data_parallel_training.py
	$(LAUNCH) --nproc_per_node 2 examples/hybrid_mlp_digits.py
	$(LAUNCH) --nproc_per_node 2 examples/pipeline_lenet.py
	$(LAUNCH) --nproc_per_node 4 examples/pipeline_module_model.py
	$(LAUNCH) --nproc_per_node 2 examples/finetune_hf.py

# Every check that needs a GPU, in one go: each step runs even where one before it failed (make -k), and the target
# fails if any did. The benchmarks write their results into benchmarks/results/, named by device.
gpu-check:
	$(MAKE) -k gpu-tests gpu-kernels gpu-grouped gpu-loss gpu-decode

# The kernels compiled, the bf16 paths, the layers on the kernels, the vocabulary's loss kernels.
gpu-tests:
	$(GPU_RUN) -m pytest -q tests/test_kernels.py tests/test_grouped.py tests/test_attention.py tests/test_cuda.py \
		tests/test_layers_triton.py \
		tests/test_vocab.py::test_loss_kernels_match_their_references

# kernels_<device>_<time>.{md,csv}: both kernels against cuBLAS, the fused epilogue, row ranges, a launch's host cost
gpu-kernels:
	$(GPU_RUN) benchmarks/kernels_gpu.py

# grouped_<device>_<time>.md: the experts' grouped GEMM against torch's grouped_mm and a loop of torch.matmul
gpu-grouped:
	$(GPU_RUN) benchmarks/grouped_gpu.py

# loss_<device>_<time>.md: the cross-entropy kernels against torch's, and Liger-Kernel's where it is installed
gpu-loss:
	$(GPU_RUN) benchmarks/loss_gpu.py

# decode_<device>_<time>.md: the triton_min_rows crossover and the host cost of a decode-sized launch
gpu-decode:
	$(GPU_RUN) benchmarks/decode_gpu.py

clean:
	rm -rf $(VENV) build *.egg-info
