"""The IQ formats' lookup tables, from the gguf package (the reference), as the native libraries take them.

`iq_tables()` gives, in the argument order of cpu_formats.c's `format_tables` and cpu_dotk.c's `dotk_tables`
(both take all of them), the grids, IQ2_XXS's sign patterns and IQ4_NL's kvalues as raw bytes, or one line
saying why the package's tables do not have the form those files read. It decodes the grids' hex: call it
once, when a library is loaded (the callers do).
"""

from __future__ import annotations


def iq_tables() -> tuple[bytes, ...] | str:
    """The IQ lookup tables cpu_formats.c and cpu_dotk.c read, from the gguf package (the reference), in their
    argument order: IQ3_XXS's and IQ3_S's grids as bytes [256, 4] and [512, 4], IQ2_XXS's 128 sign patterns,
    IQ4_NL's 16 kvalues as int8, then IQ2_XXS's, IQ2_XS's and IQ2_S's grids as bytes [256, 8], [512, 8] and
    [1024, 8], and IQ1_S's (IQ1_M's too) as int8 [2048, 8]; or why the package's tables do not have that form."""
    import gguf.quants as q  # imported here, as before the split: only a library's loading reads the package
    import numpy as np

    grids = {}
    for cls, shape in ((q.IQ3_XXS, (256, 4)), (q.IQ3_S, (512, 4)), (q.IQ2_XXS, (256, 8)), (q.IQ2_XS, (512, 8)),
                       (q.IQ2_S, (1024, 8))):
        cls.init_grid()
        grid = np.asarray(cls.grid, dtype=np.float32)
        if grid.size != shape[0] * shape[1] or not np.array_equal(grid, grid.astype(np.uint8)):
            return f"gguf's {cls.__name__} grid is not {list(shape)} whole numbers in 0..255 (shape {grid.shape})"
        grids[cls.__name__] = grid.astype(np.uint8).tobytes()
    signs, kvalues = bytes(q.IQ2_XXS.ksigns), np.array(q.IQ4_NL.kvalues)
    if len(signs) != 128 or kvalues.shape != (16,) or not np.array_equal(kvalues, kvalues.astype(np.int8)):
        return f"gguf's IQ2_XXS signs ({len(signs)} bytes) or IQ4_NL kvalues (shape {kvalues.shape}) are not 128 bytes and 16 int8s"
    q.IQ1_S.init_grid()
    iq1 = np.asarray(q.IQ1_S.grid, dtype=np.float32)
    if iq1.size != 2048 * 8 or not np.isin(iq1, (-1, 0, 1)).all():
        return f"gguf's IQ1_S grid is not [2048, 8] values in -1..1 (shape {iq1.shape})"
    return (grids["IQ3_XXS"], grids["IQ3_S"], signs, kvalues.astype(np.int8).tobytes(), grids["IQ2_XXS"], grids["IQ2_XS"],
            grids["IQ2_S"], iq1.astype(np.int8).tobytes())
