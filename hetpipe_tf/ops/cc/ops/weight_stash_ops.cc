// Op definitions of the weight stash (HetPipe, USENIX ATC 2020, section 4).
//
// A stage of a virtual worker keeps, for every minibatch p in flight, the
// weight version w_p that p's forward pass used, until p's backward pass is
// done. w_p holds all local updates of minibatches 1..p-Nm, so at most Nm
// versions are live per stage. The stash is a resource on the stage's device.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {

REGISTER_OP("HetpipeWeightStashHandle")
    .Output("handle: resource")
    .Attr("container: string = ''")
    .Attr("shared_name: string = ''")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape)
    .Doc("A handle to the weight stash of one pipeline stage.");

REGISTER_OP("HetpipeWeightStashCreate")
    .Input("handle: resource")
    .Input("capacity: int64")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc("Creates the stash; capacity is Nm, the most versions live at once.");

REGISTER_OP("HetpipeWeightStashPut")
    .Input("handle: resource")
    .Input("minibatch: int64")
    .Input("values: T")
    .Attr("T: list(type) >= 0")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc("Stashes `values` as the weight version of `minibatch`.");

REGISTER_OP("HetpipeWeightStashGet")
    .Input("handle: resource")
    .Input("minibatch: int64")
    .Output("values: dtypes")
    .Attr("dtypes: list(type) >= 0")
    .SetIsStateful()
    .SetShapeFn(shape_inference::UnknownShape)
    .Doc("Returns the weight version stashed for `minibatch`.");

REGISTER_OP("HetpipeWeightStashRelease")
    .Input("handle: resource")
    .Input("minibatch: int64")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc("Drops the weight version of `minibatch` after its backward pass.");

REGISTER_OP("HetpipeWeightStashStats")
    .Input("handle: resource")
    .Output("num_versions: int64")
    .Output("bytes: int64")
    .Output("minibatches: int64")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->Scalar());
      c->set_output(1, c->Scalar());
      c->set_output(2, c->Vector(c->UnknownDim()));
      return absl::OkStatus();
    })
    .Doc("Live versions, the bytes they hold, and their minibatch ids.");

}  // namespace tensorflow
