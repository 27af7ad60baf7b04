// Op definitions of the Wave Synchronous Parallel clock (HetPipe, USENIX ATC 2020, section 5).
//
// The parameter servers keep each virtual worker's clock (how many waves it has pushed,
// i.e. the slowest of its stages) and the global clock (the slowest worker's clock). At
// the end of clock c a worker pulls, waiting until every worker has pushed wave c - D.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {

REGISTER_OP("HetpipeWspClockHandle")
    .Output("handle: resource")
    .Attr("container: string = ''")
    .Attr("shared_name: string = ''")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape)
    .Doc("A handle to the WSP clock of the parameter servers.");

REGISTER_OP("HetpipeWspClockCreate")
    .Input("handle: resource")
    .Input("stages_per_worker: int64")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc("Creates the clock for workers with these numbers of stages.");

REGISTER_OP("HetpipeWspClockPush")
    .Input("handle: resource")
    .Input("worker: int64")
    .Input("stage: int64")
    .Input("wave: int64")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc("Records that a worker's stage pushed its update of `wave` (waves are pushed in order).");

REGISTER_OP("HetpipeWspClockWait")
    .Input("handle: resource")
    .Input("wave: int64")
    .Input("timeout_seconds: float")
    .Output("global_clock: int64")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape)
    .Doc("Completes once every worker has pushed `wave` (at once if wave < 0); returns the "
         "global clock. Asynchronous: no thread is held while it waits.");

REGISTER_OP("HetpipeWspClockAbort")
    .Input("handle: resource")
    .Input("reason: string")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc("Ends a failed run: every waiting and later wait fails at once with `reason`.");

REGISTER_OP("HetpipeWspClockRetire")
    .Input("handle: resource")
    .Input("worker: int64")
    .Input("retired: bool")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc("A worker that ended its run pushes no more waves: retired, it no longer holds back the "
         "global clock (retired=false when it starts its next run).");

REGISTER_OP("HetpipeWspClockStats")
    .Input("handle: resource")
    .Output("worker_clocks: int64")
    .Output("global_clock: int64")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->Scalar());
      return absl::OkStatus();
    })
    .Doc("Every worker's clock and the global clock.");

}  // namespace tensorflow
