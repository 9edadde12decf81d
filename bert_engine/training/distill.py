"""Knowledge distillation, DistilBERT-style: a fine-tuned task model (the teacher) teaches a student with
fewer layers, initialised from every other teacher layer, its embeddings and its head.

The loss is `alpha_soft` x the soft-target loss (KL divergence between the teacher's and the student's
distributions at `temperature`, times temperature squared, as Hinton et al.), `alpha_task` x the task's
own loss on the labels, and `alpha_cos` x the cosine loss between the two models' last hidden states at
real tokens (DistilBERT's third term). The student trains whole (no LoRA); it is saved as a plain
checkpoint of the teacher's family, which every task, `predict` and the playground load.

    bert-engine distill sentiment --teacher plugins/starter/sentiment --student-layers 3 \
        --train-file ../shared/data/sst2/train.tsv --eval-file ../shared/data/sst2/dev.tsv --output-dir runs/distil
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any

import torch
from torch import Tensor, nn

from ..heads import BertWithHead
from ..tasks.registry import RegisteredTask
from .jobs import TaskJob
from .train_config import TrainConfig

logger = logging.getLogger(__name__)

# The head outputs distillation matches: class logits (B, L), per-token logits (B, T, L), span logits (B, T).
DISTILLED_FIELDS = ("logits", "start_logits", "end_logits")


def every_other_layer(teacher_layers: int, student_layers: int) -> list[int]:
    """The teacher layers a student starts from, spread evenly from the first: 6 -> 3 gives 0, 2, 4."""
    if not 1 <= student_layers < teacher_layers:
        raise ValueError(f"student_layers must lie in [1, {teacher_layers - 1}] for a {teacher_layers}-layer teacher, "
                         f"got {student_layers}")
    return [round(i * teacher_layers / student_layers) for i in range(student_layers)]


def make_student(teacher: BertWithHead, student_layers: int) -> BertWithHead:
    """A copy of the teacher (embeddings, pooler, head) keeping `every_other_layer` of its layers."""
    config = teacher.encoder.config
    if not config.family.distillable:
        raise ValueError(f"a {config.family.name} model shares its layers across the depth; a student with fewer "
                         "layers has the same weights (use num_hidden_layers instead of distillation)")
    keep = every_other_layer(len(teacher.encoder.layers), student_layers)
    student = copy.deepcopy(teacher)
    student.encoder.layers = nn.ModuleList(student.encoder.layers[i] for i in keep)
    student.encoder.config = dataclasses.replace(config, num_hidden_layers=student_layers)
    student.encoder.schedule = list(range(student_layers))
    student.config = student.encoder.config
    for p in student.parameters():
        p.requires_grad_(True)
    logger.info("student: teacher layers %s of %d; %s parameters (teacher %s)", keep, len(teacher.encoder.layers),
                f"{sum(p.numel() for p in student.parameters()):,}", f"{sum(p.numel() for p in teacher.parameters()):,}")
    return student


def soft_target_loss(teacher_out: Any, student_out: Any, attention_mask: Tensor, temperature: float) -> Tensor:
    """KL(teacher || student) at `temperature`, x temperature^2, averaged over the fields in
    DISTILLED_FIELDS the head returns: per sequence for (B, L), per real token for (B, T, L), over the
    real tokens for span logits (B, T)."""
    losses = []
    real = attention_mask.bool()
    for name in DISTILLED_FIELDS:
        t, s = getattr(teacher_out, name, None), getattr(student_out, name, None)
        if not isinstance(t, Tensor) or not isinstance(s, Tensor):
            continue
        t, s = t.float() / temperature, s.float() / temperature
        if t.dim() == 2 and t.shape == real.shape:  # span logits: a distribution over the tokens
            t, s = t.masked_fill(~real, -1e4), s.masked_fill(~real, -1e4)
        elif t.dim() == 3:  # per-token logits: a distribution per real token
            t, s = t[real], s[real]
        kl = nn.functional.kl_div(s.log_softmax(-1), t.log_softmax(-1), log_target=True, reduction="batchmean")
        losses.append(kl * temperature ** 2)
    if not losses:
        raise ValueError(f"the head returns none of {', '.join(DISTILLED_FIELDS)}; distillation needs logits to match")
    return torch.stack(losses).mean()


def cosine_loss(teacher_hidden: Tensor, student_hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """1 - cos(teacher, student) of the last hidden states, averaged over real tokens."""
    real = attention_mask.bool()
    return (1 - nn.functional.cosine_similarity(student_hidden[real].float(), teacher_hidden[real].float(), dim=-1)).mean()


class DistillJob(TaskJob):
    """Train a student of `cfg.student_layers` layers from the teacher `cfg.teacher` on the task's data;
    evaluation, checkpoints and the best-metric pick are the task fine-tuning's."""

    kind = "distill"

    def __init__(self, task: RegisteredTask, cfg: TrainConfig) -> None:
        if not cfg.teacher:
            raise ValueError("teacher (a fine-tuned model folder of the task, or a starter model) is required")
        if cfg.lora_rank:
            raise ValueError("distillation trains the whole student; lora_rank is not used here")
        if not cfg.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {cfg.temperature!r}")
        weights = {n: getattr(cfg, n) for n in ("alpha_soft", "alpha_task", "alpha_cos")}
        if any(w < 0 for w in weights.values()) or not any(weights.values()):
            raise ValueError(f"the loss weights must be >= 0 and not all 0, got {weights}")
        super().__init__(task, dataclasses.replace(cfg, model=cfg.teacher))
        if self.loaded.untrained:
            raise ValueError(f"{cfg.teacher}: the teacher has no trained {task.spec.name} head; fine-tune it first")
        self.teacher = self.model.eval()
        for p in self.teacher.parameters():
            p.requires_grad_(False)
        self.model = make_student(self.teacher, cfg.student_layers)
        self.base_name = cfg.teacher

    def loss(self, model: nn.Module, batch, targets):
        device = next(model.parameters()).device
        if next(self.teacher.parameters()).device != device:
            self.teacher.to(device)
        inputs = batch.to(device).model_inputs()
        inputs.pop("first_token_only", None)  # the cosine loss reads every token's last hidden state
        with torch.no_grad():
            teacher_out = self.teacher(**inputs)
        student_out = model(**inputs)
        mask = inputs.get("attention_mask")
        if mask is None:
            mask = torch.ones_like(inputs["input_ids"])
        task_loss = self.spec.loss(student_out, targets)
        soft = soft_target_loss(teacher_out, student_out, mask, self.cfg.temperature)
        cos = cosine_loss(teacher_out.encoder.last_hidden_state, student_out.encoder.last_hidden_state, mask)
        cfg = self.cfg
        total = cfg.alpha_task * task_loss + cfg.alpha_soft * soft + cfg.alpha_cos * cos
        return total, {"task_loss": task_loss.item(), "soft_loss": soft.item(), "cos_loss": cos.item()}
