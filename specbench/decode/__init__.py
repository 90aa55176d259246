"""The decode core: the engine's loop (``engine``), the ragged KV cache (``kv``), the token
tree a method proposes (``tree``), the verification rules (``verify``), the target's tapped hidden states
(``hidden``) and the phase timer (``timing``). Below the runner; it names no method."""
