"""The decoding loop: arguments, host-side rows, one step's device work, stop strings, what a tree costs here, acceptance, the tree to draft, tensor-parallel ranks."""
