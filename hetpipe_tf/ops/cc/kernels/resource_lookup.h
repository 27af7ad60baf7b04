// Looking up a hetpipe_tf resource named by a kernel's first input, with an error that
// says which resource is missing where.
#ifndef HETPIPE_TF_OPS_CC_KERNELS_RESOURCE_LOOKUP_H_
#define HETPIPE_TF_OPS_CC_KERNELS_RESOURCE_LOOKUP_H_

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"

namespace tensorflow {
namespace hetpipe {

// The resource of type T behind input 0; `kind` names it in the error ("weight stash").
template <typename T>
absl::Status LookupNamedResource(OpKernelContext* ctx, const char* kind, core::RefCountPtr<T>* out) {
  const ResourceHandle& handle = HandleFromInput(ctx, 0);
  absl::Status s = LookupResource(ctx, handle, out);
  if (!s.ok()) {
    return errors::FailedPrecondition(kind, " '", handle.name(), "' does not exist on ", handle.device(),
                                      "; create it first (", s.message(), ")");
  }
  return absl::OkStatus();
}

}  // namespace hetpipe
}  // namespace tensorflow

#endif  // HETPIPE_TF_OPS_CC_KERNELS_RESOURCE_LOOKUP_H_
