VENV := .venv
PY := $(VENV)/bin/python
LAUNCH := $(PY) -m tpflow.launch

.PHONY: test demo examples clean

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test]"
	touch $@

test: $(VENV)/.installed
	$(PY) -m pytest -q

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

clean:
	rm -rf $(VENV) build *.egg-info
