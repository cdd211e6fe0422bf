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
    footprint    what a step holds and moves beyond its arguments (the planner asks it)
    placement    Placement: the state and the step on a mesh (in/out shardings), batches;
                 host_state's state_programs: a state with parts on the host, program by program
    rundir       config.json (RunConfig, schema versions), metrics.jsonl, load_run
    loop, cli    the training loop and `python -m jaxmem.train` (programs, not a library);
                 records: each finished step's bar, metrics.jsonl and trackers
"""

from jaxmem.train.footprint import Footprint, footprint
from jaxmem.train.host_state import programs as state_programs
from jaxmem.train.loss import abstract_batch, cross_entropy, synthetic_batch, token_loss
from jaxmem.train.optim import parse_loss_scale
from jaxmem.train.placement import Placement
from jaxmem.train.run import (abstract_train_state, build_step_config, make_eval_fn, objective_batch,
                              make_step_config)
from jaxmem.train.step import (StepConfig, TrainState, create_train_state, jit_train_step,
                               make_train_step, state_creation_fn)

__all__ = ["Footprint", "Placement", "StepConfig", "TrainState", "abstract_batch", "objective_batch",
           "abstract_train_state", "build_step_config", "create_train_state", "cross_entropy",
           "footprint", "jit_train_step", "make_eval_fn", "make_step_config", "make_train_step",
           "parse_loss_scale", "state_creation_fn", "state_programs", "synthetic_batch",
           "token_loss"]
