"""Independent float64 references for the adapter tests, written from quatro-math.md directly."""
import torch


def log_softmax_gather(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[s, L, V] logits, [s, L] tokens -> [s, L-1] log p(tokens[:, t+1] | tokens[:, :t+1])."""
    logp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    return logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)


def quatro_loss_reference(logprobs, old_logprobs, advantages, mask, beta, ref_logprobs=None,
                          log_ratio="seq_sum", kl_clamp=10.0):
    """QUATRO loss over a whole batch (quatro-math.md Sec. 4, Eq. 17), seq-mean-token-mean:

        L = -(1/S) sum_i s_i (A_i - sg[g_i]) + beta * (1/S) sum_i (1/|o_i|) sum_t min(k3_it, kl_clamp)
        l_i = sum_t r_it,  s_i = exp(l_i / |o_i|),  g_i = l_i (seq_sum) or l_i/|o_i| (seq_mean),
        k3 = exp(q) - q - 1 with q = log pi_ref - log pi_theta (paper App. B), capped at
        kl_clamp (the documented default 10; 0 = no cap).
    """
    mask = mask.double()
    lengths = mask.sum(-1)
    l = ((logprobs.double() - old_logprobs.double()) * mask).sum(-1)
    s = torch.exp(l / lengths)
    g = l if log_ratio == "seq_sum" else l / lengths
    loss = -(s * (advantages.double() - g.detach())).mean()
    if beta > 0:
        q = ref_logprobs.double() - logprobs.double()
        k3 = torch.exp(q) - q - 1
        if kl_clamp > 0:
            k3 = torch.minimum(k3, torch.tensor(kl_clamp, dtype=k3.dtype))
        loss = loss + beta * ((k3 * mask).sum(-1) / lengths).mean()
    return loss
