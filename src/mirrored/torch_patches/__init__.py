"""Every patch mirrored makes to torch, held by the objects that need it and removed with the
last of them (:mod:`~mirrored.torch_patches.holders`)."""
