"""The card: which components a run has, which loops they drive, and which the chosen method needs.

The unified card binds the refiner (component ``llm``) to the decode loop (``ar_decode``) and the
generator (component ``transformer``) to the denoise loop (``diffusion_denoise``); a
mixture-of-transformers card would bind one component to both loops, which the same structure
allows (``shared_weight_components`` lists every component whose weights a loop runs).

The rest of the package names components and loops only through :class:`Role` and :class:`Loop`. Their
values are plain strings, the ones checkpoints, metrics and version ledgers have always used: a key that
reaches a checkpoint stays a ``str`` (an enum member would be pickled as its class, which a
``weights_only`` load refuses).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Literal

RoleName = Literal["llm", "transformer"]
LoopName = Literal["ar_decode", "diffusion_denoise"]


class Role:
    """The two expert components of the unified card, by what they do."""

    REFINER: Final = "llm"  # the causal LM that rewrites the prompt
    GENERATOR: Final = "transformer"  # the flow transformer that draws the image


class Loop:
    """The loops a card can declare: autoregressive decoding and flow denoising."""

    DECODE: Final = "ar_decode"
    DENOISE: Final = "diffusion_denoise"


LOOPS: tuple[LoopName, ...] = (Loop.DECODE, Loop.DENOISE)
MODES = ("joint", "prompt_only", "generator_only")
# Which loops each mode needs, and which loops' experts it trains. A loop the card declares but the mode
# does not train still runs, frozen: the mode says what learns, the card says what the pipeline is.
_MODE_LOOPS = {
    "joint": ({Loop.DECODE, Loop.DENOISE}, {Loop.DECODE, Loop.DENOISE}),
    "prompt_only": ({Loop.DECODE, Loop.DENOISE}, {Loop.DECODE}),
    "generator_only": ({Loop.DENOISE}, {Loop.DENOISE}),
}


class CardError(ValueError):
    """A card that cannot run: a loop bound to an undeclared component, a missing loop, a bad mode."""


@dataclass
class Card:
    """Components (name -> ``"expert"`` if trainable with LoRA, else ``"frozen"``) and loops.

    ``loops`` maps a loop name to its ``shared_weight_components``: the components whose weights
    that loop runs. ``validate(mode)`` rejects anything the method cannot run on.
    """

    components: dict[str, str]
    loops: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def unified(cls, *, has_llm: bool = True, has_vae: bool = True) -> Card:
        """The two-expert card of UniRL-Zero / PromptRL: a refiner LM and a flow DiT, plus frozen parts."""
        components = {Role.GENERATOR: "expert", "text_encoder": "frozen"}
        loops: dict[str, list[str]] = {Loop.DENOISE: [Role.GENERATOR]}
        if has_llm:
            components[Role.REFINER] = "expert"
            loops[Loop.DECODE] = [Role.REFINER]
        if has_vae:
            components["vae"] = "frozen"
        return cls(components=components, loops=loops)

    def validate(self, mode: str) -> None:
        """Raise :class:`CardError` naming the problem if ``mode`` cannot run on this card."""
        if mode not in MODES:
            raise CardError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
        for comp, role in self.components.items():
            if role not in ("expert", "frozen"):
                raise CardError(f"component {comp!r} has role {role!r}; expected 'expert' or 'frozen'")
        for loop, bound in self.loops.items():
            if loop not in LOOPS:
                raise CardError(f"unknown loop {loop!r}; expected one of {', '.join(LOOPS)}")
            if not bound:
                raise CardError(f"loop {loop!r} binds no component")
            for comp in bound:
                if comp not in self.components:
                    raise CardError(f"loop {loop!r} is bound to undeclared component {comp!r}")
        needed, _ = _MODE_LOOPS[mode]
        for loop in sorted(needed - set(self.loops)):
            raise CardError(f"mode {mode!r} needs loop {loop!r}, which the card does not declare")

    def trained_components(self, mode: str) -> list[str]:
        """The experts this mode updates, in a fixed order (the order of their optimizers)."""
        _, trained_loops = _MODE_LOOPS[mode]
        names: list[str] = []
        for loop in LOOPS:
            if loop in trained_loops:
                names += [c for c in self.loops.get(loop, []) if self.components[c] == "expert"]
        return list(dict.fromkeys(names))

    def loops_of(self, component: str) -> list[str]:
        """The loops whose weights include ``component``, in the fixed loop order."""
        return [loop for loop in LOOPS if component in self.loops.get(loop, [])]

    def owner(self, loop: str) -> str:
        """The expert a loop trains (its first bound expert component); its version stamps the loop's records."""
        experts = [c for c in self.loops[loop] if self.components[c] == "expert"]
        if not experts:
            raise CardError(f"loop {loop!r} binds no expert component")
        return experts[0]

    def runs_loop(self, mode: str, loop: str) -> bool:
        """Whether ``mode`` runs ``loop``: every loop it needs, plus any other loop the card declares
        (``generator_only`` on a card with a refiner runs ``ar_decode`` frozen; on one without, not at all)."""
        return loop in _MODE_LOOPS[mode][0] or loop in self.loops
