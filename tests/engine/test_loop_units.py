"""Pure pieces of the training loop: data position, data-parallel slots, mixed-precision AdamW."""
import torch

from quatro_nemo.engine.loop import local_prompt_slots, step_prompt_indices
from quatro_nemo.engine.optim import MasterWeightAdamW, build_optimizer


def test_prompt_stream_is_a_pure_function_of_the_step_and_covers_each_epoch_once():
    dataset, batch = 10, 4
    steps = [step_prompt_indices(s, batch, dataset, seed=3) for s in range(5)]   # 20 draws = 2 epochs
    flat = [i for s in steps for i in s]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != list(range(10))                                        # shuffled
    assert steps == [step_prompt_indices(s, batch, dataset, seed=3) for s in range(5)]  # no hidden state
    assert steps != [step_prompt_indices(s, batch, dataset, seed=4) for s in range(5)]


def test_data_parallel_slots_partition_every_mini_batch_evenly():
    batch, mini, dp = 12, 6, 3
    per_rank = [local_prompt_slots(batch, mini, r, dp) for r in range(dp)]
    assert sorted(s for slots in per_rank for s in slots) == list(range(batch))
    for start in range(0, batch, mini):                      # each optimizer step: 2 prompts per rank
        for slots in per_rank:
            assert sum(start <= s < start + mini for s in slots) == mini // dp
    assert local_prompt_slots(batch, batch, 0, 1) == list(range(batch))


def test_master_weights_keep_updates_that_bf16_parameters_would_lose():
    torch.manual_seed(0)
    start = torch.randn(64).to(torch.bfloat16).float()   # exactly representable in bf16
    grads = [torch.randn(64) for _ in range(5)]
    lr = 1e-6

    bf16 = torch.nn.Parameter(start.to(torch.bfloat16))
    optimizer = MasterWeightAdamW([bf16], lr=lr, weight_decay=0.0)
    reference = torch.nn.Parameter(start.double().clone())               # float64 AdamW, same grads
    ref_opt = torch.optim.AdamW([reference], lr=lr, weight_decay=0.0)
    naive = torch.nn.Parameter(start.to(torch.bfloat16))                 # AdamW directly on bf16
    naive_opt = torch.optim.AdamW([naive], lr=lr, weight_decay=0.0)
    for g in grads:
        bf16.grad, reference.grad, naive.grad = g.to(torch.bfloat16), g.to(torch.bfloat16).double(), g.to(torch.bfloat16)
        optimizer.step(); ref_opt.step(); naive_opt.step()
    master = optimizer.masters[0]
    # AdamW moves each weight by ~lr per step: 5e-6 after 5 steps, kept to float32 precision
    assert (master.double() - reference.detach()).abs().max() < 5e-7
    assert (master - start).abs().max() > 2e-6
    assert torch.equal(naive.detach(), start.to(torch.bfloat16))           # ... and lost without masters
    # A step large enough for bf16 to see: the model's parameter is the master, rounded to bf16.
    optimizer.optimizer.param_groups[0]["lr"] = 1e-1
    bf16.grad = grads[0].to(torch.bfloat16)
    optimizer.step()
    assert torch.equal(bf16.detach(), optimizer.masters[0].to(torch.bfloat16))
    assert not torch.equal(bf16.detach(), start.to(torch.bfloat16))

    state = optimizer.state_dict()
    again = MasterWeightAdamW([torch.nn.Parameter(start.to(torch.bfloat16))], lr=lr, weight_decay=0.0)
    again.load_state_dict(state)
    assert torch.equal(again.masters[0], master)


def test_float32_models_get_plain_adamw():
    model = torch.nn.Linear(3, 2)
    optimizer, scheduled = build_optimizer(model, 1e-3, (0.9, 0.999), 1e-8, 0.0)
    assert isinstance(optimizer, torch.optim.AdamW) and scheduled is optimizer
    model_bf16 = torch.nn.Linear(3, 2).to(torch.bfloat16)
    optimizer, scheduled = build_optimizer(model_bf16, 1e-3, (0.9, 0.999), 1e-8, 0.0)
    assert isinstance(optimizer, MasterWeightAdamW) and scheduled is optimizer.optimizer
