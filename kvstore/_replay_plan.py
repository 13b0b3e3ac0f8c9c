"""What ``kvstore replay`` tries and what it recommends.

Starting from the user's config, each variant changes one thing: one tier's eviction
policy, one tier's admission (``min_hits`` 1, 2, 3) or one tier's capacity (×0.5, ×2,
×4). Every variant replays as the same tiers turned into DRAM tiers of as many 4 KiB
slots as the real tier holds blocks (:mod:`kvstore._replay`), with the config's
placement, so the Store's own eviction, admission, spill and promotion code decides.
``admission.bytes_per_s`` is left out of replays: a replay runs far faster than the
traffic did, so a write budget per second would throttle what never was.

The recommendation keeps the capacities: the best eviction policy and admission per
tier (a change counts when it raises the prefix hit rate by at least 0.1 point, or
keeps it within 0.1 point while cutting that tier's writes by a tenth or more), taken
greedily and each combination replayed, so the gain it states is one the Store
measured.

An :class:`Objective` says what "better" means: ``hit`` (the default, the rule above)
or ``wear=W``, which weighs a tier's bytes written against hit rate: a change scores its
gain in points of prefix hit rate minus ``W`` points per 100% more bytes written to the
tier (``wear=1``: cutting a tier's writes by two thirds is worth 0.67 point), and counts
when it scores at least 0.1. :func:`why_not` says, for each candidate step that was not
recommended, why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvstore._replay import PAYLOAD_BYTES, ReplayResult
from kvstore.config import StoreConfig

MIN_HITS = (1, 2, 3)
SCALES = (0.5, 2.0, 4.0)
HIT_EPSILON = 0.001     # 0.1 point of prefix hit rate
WEAR_CUT = 0.10         # a tenth fewer bytes written


@dataclass
class TierSetting:
    eviction: str
    min_hits: int
    capacity_blocks: int


@dataclass
class Variant:
    """One replayed configuration; ``changes`` says what differs from the user's."""

    label: str
    kind: str                      # configured | eviction | admission | capacity | recommended
    tiers: list[TierSetting]
    changes: list[str] = field(default_factory=list)
    result: ReplayResult | None = None


def tier_blocks(config: StoreConfig, block_bytes: int) -> list[int]:
    """How many blocks of ``block_bytes`` each tier holds (at least one)."""
    return [max(1, tier.capacity // block_bytes) for tier in config.tiers]


def configured(config: StoreConfig, block_bytes: int) -> Variant:
    settings = [TierSetting(t.eviction, t.admission.min_hits, blocks)
                for t, blocks in zip(config.tiers, tier_blocks(config, block_bytes))]
    return Variant("as configured", "configured", settings)


def variants(config: StoreConfig, block_bytes: int, policies: Sequence[str]) -> list[Variant]:
    """The configured setup first, then every one-change variant of it."""
    base = configured(config, block_bytes)
    out = [base]
    for i, tier in enumerate(config.tiers):
        def changed(kind: str, label: str, **values) -> Variant:
            settings = [TierSetting(s.eviction, s.min_hits, s.capacity_blocks) for s in base.tiers]
            for name, value in values.items():
                setattr(settings[i], name, value)
            return Variant(f"{tier.name}: {label}", kind, settings, [f"{tier.name}: {label}"])

        for policy in policies:
            if policy != tier.eviction:
                out.append(changed("eviction", f"eviction {policy}", eviction=policy))
        for min_hits in MIN_HITS:
            if min_hits != tier.admission.min_hits:
                out.append(changed("admission", f"min_hits {min_hits}", min_hits=min_hits))
        for scale in SCALES:
            blocks = max(1, int(base.tiers[i].capacity_blocks * scale))
            out.append(changed("capacity", f"capacity x{scale:g}", capacity_blocks=blocks))
    return out


def replay_config(config: StoreConfig, variant: Variant, distinct_blocks: int) -> dict:
    """The Store config a variant replays with. A tier larger than the trace's distinct
    blocks never fills, so its slots are capped there (same behaviour, less memory)."""
    tiers = [{"name": tier.name, "kind": "dram",
              "capacity": min(s.capacity_blocks, distinct_blocks + 1) * PAYLOAD_BYTES,
              "eviction": s.eviction, "admission": {"min_hits": s.min_hits}}
             for tier, s in zip(config.tiers, variant.tiers)]
    return {"tiers": tiers, "placement": config.placement.model_dump(), "io_threads": 1}


@dataclass(frozen=True)
class Objective:
    """What a recommended change must improve (see the module docstring):
    ``wear_weight`` ``None``: ``hit``; a number ``W``: ``wear=W``."""

    wear_weight: float | None = None

    @classmethod
    def parse(cls, text: str) -> "Objective":
        if text == "hit":
            return cls()
        name, _, value = text.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if name != "wear" or not weight >= 0 or weight == float("inf"):
            raise ValueError(f"unknown objective {text!r}: give 'hit' or 'wear=W' (W >= 0: points of hit rate "
                             "one 100% change in a tier's bytes written is worth)")
        return cls(weight)

    def __str__(self) -> str:
        return "hit" if self.wear_weight is None else f"wear={self.wear_weight:g}"

    def score(self, candidate: ReplayResult, base: ReplayResult, tier: int) -> float | None:
        """``wear=W``: the change's score in points; ``hit``: ``None``."""
        if self.wear_weight is None:
            return None
        before = base.tier_blocks_written[tier]
        wear = (candidate.tier_blocks_written[tier] - before) / before if before else 0.0
        return 100 * (candidate.hit_rate - base.hit_rate) - self.wear_weight * 100 * wear


def _better(candidate: ReplayResult, base: ReplayResult, tier: int, objective: Objective = Objective()) -> bool:
    score = objective.score(candidate, base, tier)
    if score is not None:
        return score >= 100 * HIT_EPSILON
    gain = candidate.hit_rate - base.hit_rate
    if gain >= HIT_EPSILON:
        return True
    written, before = candidate.tier_blocks_written[tier], base.tier_blocks_written[tier]
    return gain > -HIT_EPSILON and before > 0 and written <= (1 - WEAR_CUT) * before


def _tier_of(config: StoreConfig, variant: Variant) -> int:
    return next(i for i, t in enumerate(config.tiers) if variant.label.startswith(f"{t.name}: "))


def why_not(config: StoreConfig, tried: Sequence[Variant], best: Variant | None,
            objective: Objective = Objective()) -> list[tuple[str, str]]:
    """``(label, reason)`` for each eviction and admission step tried alone that the
    recommendation does not include."""
    base = tried[0].result
    taken = set(best.changes) if best is not None else set()
    out = []
    for v in tried:
        if v.kind not in ("eviction", "admission") or v.label in taken:
            continue
        i = _tier_of(config, v)
        r = v.result
        points = 100 * (r.hit_rate - base.hit_rate)
        before, after = base.tier_blocks_written[i], r.tier_blocks_written[i]
        wear = f"{(after - before) / before:+.0%} bytes written to {config.tiers[i].name}" if before else \
            f"{after} blocks written to {config.tiers[i].name}"
        score = objective.score(r, base, i)
        if _better(r, base, i, objective):
            reason = f"{points:+.2f} points, {wear}: helps alone, but another change to this tier helped more " \
                     "or it did not help on top of the changes taken"
        elif score is not None:
            reason = f"{points:+.2f} points, {wear}: scores {score:+.2f} under --objective {objective} " \
                     f"(needs +{100 * HIT_EPSILON:.1f})"
        elif points <= -100 * HIT_EPSILON:
            reason = f"{points:+.2f} points ({wear}): costs hit rate (--objective wear=W weighs writes against it)"
        else:
            reason = (f"{points:+.2f} points, {wear}: gains less than {100 * HIT_EPSILON:.1f} point and cuts "
                      f"writes by less than {WEAR_CUT:.0%}")
        out.append((v.label, reason))
    return out


def _rank(v: Variant, base: Variant, tier: int, objective: Objective) -> tuple:
    if objective.wear_weight is None:
        return (v.result.hit_rate, -v.result.tier_blocks_written[tier])
    return (objective.score(v.result, base.result, tier), v.result.hit_rate)


def recommend(config: StoreConfig, tried: Sequence[Variant],
              replay: Callable[[Variant], ReplayResult], objective: Objective = Objective()) -> Variant | None:
    """The same-capacity changes worth making, or ``None`` when no eviction or admission
    change helps. Each tier's best eviction and admission change (see the module
    docstring) are taken greedily, best single gain first, each kept only when it still
    helps on top of those already taken (changes interact: a tier's admission changes
    what the tier below it sees). ``replay`` runs a combined variant."""
    base = tried[0]
    singles = []
    for i, tier in enumerate(config.tiers):
        prefix = f"{tier.name}: "
        for kind in ("eviction", "admission"):
            options = [v for v in tried if v.kind == kind and v.label.startswith(prefix)
                       and _better(v.result, base.result, i, objective)]
            if options:
                singles.append((i, max(options, key=lambda v, i=i: _rank(v, base, i, objective))))
    if objective.wear_weight is None:
        singles.sort(key=lambda pair: pair[1].result.hit_rate, reverse=True)
    else:
        singles.sort(key=lambda pair: objective.score(pair[1].result, base.result, pair[0]), reverse=True)
    best: Variant | None = None
    for i, option in singles:
        if best is None:
            best = option
            continue
        settings = [TierSetting(s.eviction, s.min_hits, s.capacity_blocks) for s in best.tiers]
        settings[i].eviction, settings[i].min_hits = option.tiers[i].eviction, option.tiers[i].min_hits
        trial = Variant("", "recommended", settings, [*best.changes, *option.changes])
        trial.result = replay(trial)
        if _better(trial.result, best.result, i, objective):
            best = trial
    if best is None:
        return None
    return Variant("recommended: " + "; ".join(best.changes), "recommended", best.tiers, best.changes,
                   best.result)


def yaml_change(config: StoreConfig, variant: Variant) -> list[str]:
    """The config edits a variant stands for, as lines of YAML-ish text."""
    lines = []
    for i, (tier, s) in enumerate(zip(config.tiers, variant.tiers)):
        if s.eviction != tier.eviction:
            lines.append(f"tiers[{i}] ({tier.name}).eviction: {tier.eviction} -> {s.eviction}")
        if s.min_hits != tier.admission.min_hits:
            lines.append(f"tiers[{i}] ({tier.name}).admission.min_hits: {tier.admission.min_hits} -> {s.min_hits}")
    return lines
