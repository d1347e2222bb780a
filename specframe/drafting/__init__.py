"""The drafter building blocks: what a drafter is made of, below the API that re-exports them.

- ``elements``: the (anchor, depth) element model and its visibility rules, shared by every drafter.
- ``decoder`` and ``modeling``: Llama-style layers over element sets, and the losses over a drafter's head
  (``api.modeling``).
- ``eagle``, ``family`` and ``family_options``: the pieces of the drafters that read the target's features,
  what their classes declare alike and the options they share (``api.eagle``).
- ``block``: the block-drafting backbone DFlash and DSpark share (``api.block``).
- ``vocab``: the draft vocabulary; ``calibration``: a drafter's confidence calibration (``api.calibration``).
- ``drafts``, ``draft_tree`` and ``queued_inference``: what a drafter proposes, the EAGLE-2 tree, and the queue of
  committed tokens a drafter has not forwarded yet.

Plugins reach these through ``specframe.api`` only (an import-linter contract says so).
"""
