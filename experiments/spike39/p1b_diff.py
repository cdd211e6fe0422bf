import functools, jax, numpy as np
from common import *
w, m, v, g = data()
a = jax.jit(functools.partial(step_adam, offload=False, prefetch=False))(w, m, v, g)
b = jax.jit(functools.partial(step_adam, offload=False, prefetch=True))(w, m, v, g)
print("all-device prefetch vs no-prefetch bitwise (w,m,v):", [bool(np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))) for x, y in zip(a, b)],
      "max|dm|:", float(np.max(np.abs(np.asarray(a[1]) - np.asarray(b[1])))))
