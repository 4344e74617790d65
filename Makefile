# The two commands a new user needs (see README.md).
#   make train [NPROC=2] [ARGS="algorithm=gspo trainer.steps=40"]
#   make test  [ARGS="-k dual"]
NPROC ?= 2

.PHONY: train test

train:  ## install into .venv, then run the embedded CPU default (data parallel over NPROC processes)
	bash scripts/bootstrap.sh train
	OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node $(NPROC) \
		recipes/train.py $(ARGS)

test:   ## install into .venv, then run the whole test suite
	bash scripts/run_tests.sh $(ARGS)
