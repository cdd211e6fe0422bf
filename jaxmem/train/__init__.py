"""Training: the state, the one jitted step, its loss, loss scale and optimizer (precision modes:
jaxmem.model.precision; the loss scales themselves: jaxmem.optim).

    step         TrainState, StepConfig, create_train_state (under jit; state_creation_fn is the
                 function it compiles, for planners), make_train_step, jit_train_step
    loss         cross_entropy, token_loss (the step's loss), synthetic / abstract batches
    optim        --optimizer: AdamW / 8-bit AdamW (updated in place: jaxmem.optim) / ...,
                 warmup + cosine schedule, decay mask, the trainer's jaxmem.optim.Optimizer;
                 the --loss-scale spec (the scales: jaxmem.optim, torch GradScaler semantics)
    run          RunConfig -> StepConfig (build_step_config), abstract state, eval function,
                 compile_run_step (the run's step compiled on abstract shapes)
    placement    Placement: the state and the step on a mesh (in/out shardings), batches
    rundir       config.json (RunConfig, schema versions), metrics.jsonl, load_run
    loop, cli    the training loop and `python -m jaxmem.train` (programs, not a library);
                 records: each finished step's bar, metrics.jsonl and trackers
"""

from jaxmem.train.loss import cross_entropy, token_loss
from jaxmem.train.optim import parse_loss_scale
from jaxmem.train.run import abstract_train_state, build_step_config, make_eval_fn
from jaxmem.train.step import (StepConfig, TrainState, create_train_state, jit_train_step,
                               make_train_step, state_creation_fn)

__all__ = ["StepConfig", "TrainState", "abstract_train_state", "build_step_config",
           "create_train_state", "cross_entropy", "jit_train_step", "make_eval_fn",
           "make_train_step", "parse_loss_scale", "state_creation_fn", "token_loss"]
