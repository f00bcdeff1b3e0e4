"""Hugging Face names that fail on XLA or in transformers 5: ``save_pretrained`` of an XLA model, ``transformers.AdamW``;
named: peft's removed ``prepare_model_for_int8_training``, a ``Trainer`` (its own loop)."""

from __future__ import annotations

from typing import Any

from .registry import Porter, fixes
from .tree import code, dotted, drop_imported, keyword, libcst

_PEFT_REMOVED = ("prepare_model_for_int8_training",)
_TRAINERS = ("Trainer", "Seq2SeqTrainer", "SFTTrainer")  # transformers' and trl's loops of their own
_SAVE = "{}.save_pretrained({}, state_dict={{k: v.cpu() for k, v in {}.state_dict().items()}})"


@fixes("ImportFrom", order=20)
def fix_import(porter: Porter, original: Any, updated: Any) -> Any:
    """``from transformers import AdamW, get_scheduler`` -> AdamW from torch.optim."""
    cst = libcst()
    if updated.module is not None and dotted(updated.module) == "peft" and not isinstance(updated.names, cst.ImportStar):
        if any(a.name.value in _PEFT_REMOVED for a in updated.names if isinstance(a.name, cst.Name)):
            porter.leave_alone("peft_removed", original)
        return None
    if updated.module is None or isinstance(updated.names, cst.ImportStar):
        return None
    if dotted(updated.module) in ("transformers", "trl"):
        porter.plan.hf_trainers.update(a.asname.name.value if a.asname else a.name.value for a in updated.names
                                       if isinstance(a.name, cst.Name) and a.name.value in _TRAINERS)  # fmt: skip
    if dotted(updated.module) != "transformers":
        return None
    ours = [a for a in updated.names if a.name.value == "AdamW"]
    if not ours:
        return None
    porter.plan.hf_adamw.add(ours[0].asname.name.value if ours[0].asname else "AdamW")
    porter.plan.imports.append(("torch.optim", "AdamW", ours[0].asname.name.value if ours[0].asname else None))
    return drop_imported(porter, "transformers_adamw", original, updated, ("AdamW",))


@fixes("Call", order=130)
def fix_call(porter: Porter, original: Any, updated: Any) -> Any:
    """``AdamW(...)`` imported from transformers keeps its default ``weight_decay=0.0``; ``model.save_pretrained(dir)``."""
    cst = libcst()
    name = dotted(updated.func)
    last = name.rsplit(".", 1)[-1]
    if last in _PEFT_REMOVED and name in (last, f"peft.{last}"):
        porter.leave_alone("peft_removed", original)
        return None
    if name in porter.plan.hf_trainers or (last in _TRAINERS and name in (f"transformers.{last}", f"trl.{last}")):
        porter.leave_alone("hf_trainer", original)
        return None
    if name in porter.plan.hf_adamw or name == "transformers.AdamW":
        if keyword(updated, "correct_bias") is not None:
            porter.leave_alone("transformers_adamw", original)
            return None
        args = list(updated.args)
        if keyword(updated, "weight_decay") is None and not (len(args) > 3 and args[3].keyword is None):
            last = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
            args = [*args[:-1], last, cst.Arg(cst.Float("0.0"), keyword=cst.Name("weight_decay"),
                                              equal=cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace("")))]  # fmt: skip
        new = updated.with_changes(func=cst.parse_expression("torch.optim.AdamW") if name == "transformers.AdamW"
                                   else updated.func, args=args)  # fmt: skip
        porter.change("transformers_adamw", original, new)
        return new
    if isinstance(updated.func, cst.Attribute) and updated.func.attr.value == "save_pretrained":
        owner = dotted(updated.func.value)
        if keyword(updated, "state_dict") is not None or not updated.args:
            return None
        if owner in porter.plan.models:
            given = ", ".join(code(a).strip().rstrip(",") for a in updated.args)
            new = cst.parse_expression(_SAVE.format(owner, given, owner))
            porter.change("save_pretrained", original, new)
            return new
        if "model" in owner:
            porter.leave_alone("save_pretrained", original)
    return None
