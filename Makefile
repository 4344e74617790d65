# The two commands a new user needs (see README.md).
.PHONY: train test

train:  ## install into .venv and run the embedded CPU default end to end
	bash scripts/bootstrap.sh
	OMP_NUM_THREADS=1 .venv/bin/python recipes/train.py $(ARGS)

test:   ## install into .venv and run the whole test suite
	bash scripts/run_tests.sh $(ARGS)
