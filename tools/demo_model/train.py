"""Stage 4 of the demo build: transformers' Qwen3_5MoeForCausalLM trained on CPU, one thread,
seeded (AdamW, warmup then cosine, a time guard), and the experts' load after training."""
from __future__ import annotations

import math
import random
import time

from .common import TEXT_CONFIG, fail, log


def make_torch_model(seed: int, experts_impl: str | None):
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    cfg = Qwen3_5MoeTextConfig(**{k: v for k, v in TEXT_CONFIG.items() if k != "model_type"})
    if list(cfg.layer_types) != TEXT_CONFIG["layer_types"]:
        fail(f"transformers derived layer_types {cfg.layer_types}, expected {TEXT_CONFIG['layer_types']}")
    if experts_impl:
        cfg._experts_implementation = experts_impl
    torch.manual_seed(seed)
    return Qwen3_5MoeForCausalLM(cfg)


def evaluate(model, windows, batch: int) -> float:
    import torch
    model.eval()
    tot, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            x = torch.tensor(windows[i:i + batch])
            out = model(input_ids=x, labels=x)
            k = x.shape[0] * (x.shape[1] - 1)
            tot += float(out.loss) * k
            n += k
    model.train()
    return tot / n


def train(model, data, args) -> dict:
    import torch
    torch.set_num_threads(1)
    rng = random.Random(args.seed + 1)
    windows = data["train_windows"]
    order: list[int] = []
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    warmup = max(1, min(args.warmup, args.steps // 5))

    def lr_at(step: int) -> float:   # step counts from 1
        if step <= warmup:
            return args.lr * step / warmup
        p = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))

    eval_train = windows[:: max(1, len(windows) // args.eval_windows)][: args.eval_windows]
    eval_held = data["held_windows"][: args.eval_windows]
    model.config.output_router_logits = True     # adds router_aux_loss_coef * load-balancing loss
    t0 = time.time()
    curve, window_loss, window_n, stopped_early = [], 0.0, 0, False
    log(f"[train] {args.steps} steps x {args.batch} x {args.seq_len} tokens, lr {args.lr} "
        f"(warmup {warmup}, cosine to 10%), AdamW wd {args.weight_decay}, clip {args.clip}, "
        f"seed {args.seed}, guard {args.max_minutes} min, torch threads {torch.get_num_threads()}")
    log(f"[train] {'step':>5} {'lr':>8} {'loss':>7} {'held-out':>8} {'tok/s':>6} {'min':>5}")
    step = 0
    for step in range(1, args.steps + 1):
        if len(order) < args.batch:
            perm = list(range(len(windows)))
            rng.shuffle(perm)
            order.extend(perm)
        idx, order = order[: args.batch], order[args.batch:]
        x = torch.tensor([windows[i] for i in idx])
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        lm_loss = out.loss.item() - TEXT_CONFIG["router_aux_loss_coef"] * out.aux_loss.item()
        window_loss += lm_loss
        window_n += 1
        elapsed = time.time() - t0
        last = step == args.steps or elapsed > args.max_minutes * 60
        if step % args.log_every == 0 or step == 1 or last:
            held = ""
            entry = {"step": step, "lr": lr_at(step), "train_loss": window_loss / window_n,
                     "minutes": elapsed / 60}
            if step % (args.log_every * 5) == 0 or last:
                model.config.output_router_logits = False
                entry["held_out_loss"] = evaluate(model, eval_held, args.batch)
                model.config.output_router_logits = True
                held = f"{entry['held_out_loss']:8.4f}"
            curve.append(entry)
            tps = step * args.batch * args.seq_len / max(elapsed, 1e-9)
            log(f"[train] {step:5d} {entry['lr']:8.2e} {entry['train_loss']:7.4f} {held:>8} "
                f"{tps:6.0f} {elapsed / 60:5.1f}")
            window_loss, window_n = 0.0, 0
        if elapsed > args.max_minutes * 60 and step < args.steps:
            stopped_early = True
            log(f"[train] time guard: stopped after {step} of {args.steps} steps "
                f"({elapsed / 60:.1f} min > --max-minutes {args.max_minutes}); the result is not "
                f"the reproducible {args.steps}-step model")
            break
    model.config.output_router_logits = False
    minutes = (time.time() - t0) / 60
    final_train = evaluate(model, eval_train, args.batch)
    final_held = evaluate(model, eval_held, args.batch)
    log(f"[train] done: {step} steps in {minutes:.1f} min; loss on {len(eval_train)} training "
        f"windows {final_train:.4f} nats/token (perplexity {math.exp(final_train):.1f}), on "
        f"{len(eval_held)} held-out windows {final_held:.4f} (perplexity {math.exp(final_held):.1f})")
    return {"steps": step, "planned_steps": args.steps, "stopped_early": stopped_early,
            "minutes": round(minutes, 2), "final_train_loss": round(final_train, 4),
            "final_held_out_loss": round(final_held, 4), "eval_windows": len(eval_train),
            "curve": curve, "tokens_seen": step * args.batch * args.seq_len}


def expert_usage(model, windows) -> list[list[int]]:
    """Per layer: how many of the tokens' top-k slots each expert received."""
    import torch
    counts = []
    hooks = []

    def hook(_m, _inp, out):
        _, _, idx = out
        counts.append(torch.bincount(idx.flatten(), minlength=TEXT_CONFIG["num_experts"]).tolist())

    for layer in model.model.layers:
        hooks.append(layer.mlp.gate.register_forward_hook(hook))
    with torch.no_grad():
        model(input_ids=torch.tensor(windows))
    for h in hooks:
        h.remove()
    return counts
