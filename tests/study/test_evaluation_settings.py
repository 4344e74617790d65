"""The held-out evaluation's settings (an EvalRequest, the study's): the run's response length,
micro-batching and UCC criterion, the request's sampling, and a noise seed chosen by the request's
seed alone (not the run's)."""
from quatro_nemo.engine.config import load_config
from quatro_nemo.engine.heldout import EvalRequest, heldout_settings


def study_eval_settings(cfg, n_samples, top_p, temperature, seed):
    return heldout_settings(cfg, EvalRequest(num_problems=1, n_samples=n_samples, top_p=(top_p,),
                                             temperature=temperature, seed=seed), top_p)


def test_study_evaluation_noise_comes_from_the_study_seed_not_the_run_seed():
    cfg = load_config(["run.seed=5", "rollout.max_new_tokens=20", "parallel.micro_batch_size=3",
                       "eval.ucc_criterion=task", "eval.n_samples=4", "eval.top_p=0.9"])
    settings = study_eval_settings(cfg, n_samples=16, top_p=1.0, temperature=0.8, seed=3)
    # the committed studies drew their evaluation noise with run.seed=<evaluation seed> and
    # evaluate_policy's seed run.seed + 7919: seed 3 -> 7922, whatever the run's own seed
    assert settings.seed == 7922
    assert study_eval_settings(load_config(["run.seed=6"]), 16, 1.0, 0.8, seed=3).seed == 7922
    assert (settings.n_samples, settings.top_p, settings.temperature) == (16, 1.0, 0.8)
    assert settings.max_new_tokens == 20 and settings.micro_batching.rows == 3
    assert settings.ucc_criterion == "task"
    assert settings.sampling_params().seed == 7922 and settings.sampling_params().top_p == 1.0
