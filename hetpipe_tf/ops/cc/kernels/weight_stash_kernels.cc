// Kernels of the weight stash (HetPipe section 4): a map from minibatch id to
// the tensors of that minibatch's weight version, on the stage's device.
//
// Tensors are kept by reference. A variable read shares its buffer with the
// stashed tensor until the variable is next updated; TensorFlow then copies
// the variable's buffer (copy on write), so a stashed version never changes.
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/mutex.h"
#include "resource_lookup.h"

namespace tensorflow {
namespace {

class WeightStash : public ResourceBase {
 public:
  explicit WeightStash(int64_t capacity) : capacity_(capacity) {}

  std::string DebugString() const override {
    mutex_lock l(mu_);
    return absl::StrCat("WeightStash(capacity=", capacity_,
                        ", live=", LiveList(), ")");
  }

  int64_t capacity() const { return capacity_; }

  absl::Status Put(const std::string& name, int64_t minibatch,
                   std::vector<Tensor> values) {
    mutex_lock l(mu_);
    if (versions_.count(minibatch) > 0) {
      return errors::AlreadyExists(
          "weight stash '", name, "': minibatch ", minibatch,
          " already has a stashed version; a version is stashed once per "
          "minibatch (live versions: ",
          LiveList(), ")");
    }
    if (static_cast<int64_t>(versions_.size()) >= capacity_) {
      return errors::ResourceExhausted(
          "weight stash '", name, "': cannot stash the version of minibatch ",
          minibatch, ": ", versions_.size(), " versions are live (minibatches ",
          LiveList(), ") and at most Nm=", capacity_,
          " may be; a version is released after its minibatch's backward "
          "pass, before a new one is stashed");
    }
    int64_t bytes = 0;
    for (const Tensor& t : values) bytes += t.TotalBytes();
    bytes_ += bytes;
    versions_.emplace(minibatch, std::move(values));
    return absl::OkStatus();
  }

  absl::Status Get(const std::string& name, int64_t minibatch,
                   std::vector<Tensor>* out) {
    mutex_lock l(mu_);
    auto it = versions_.find(minibatch);
    if (it == versions_.end()) return Missing(name, minibatch);
    *out = it->second;
    return absl::OkStatus();
  }

  absl::Status Release(const std::string& name, int64_t minibatch) {
    mutex_lock l(mu_);
    auto it = versions_.find(minibatch);
    if (it == versions_.end()) return Missing(name, minibatch);
    for (const Tensor& t : it->second) bytes_ -= t.TotalBytes();
    versions_.erase(it);
    return absl::OkStatus();
  }

  void Stats(int64_t* num, int64_t* bytes, std::vector<int64_t>* ids) {
    mutex_lock l(mu_);
    *num = versions_.size();
    *bytes = bytes_;
    ids->clear();
    for (const auto& kv : versions_) ids->push_back(kv.first);
  }

 private:
  std::string LiveList() const TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<int64_t> ids;
    for (const auto& kv : versions_) ids.push_back(kv.first);
    return absl::StrCat("[", absl::StrJoin(ids, ", "), "]");
  }

  absl::Status Missing(const std::string& name, int64_t minibatch) const
      TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return errors::NotFound("weight stash '", name,
                            "': no version is stashed for minibatch ",
                            minibatch, " (live versions: ", LiveList(), ")");
  }

  const int64_t capacity_;
  mutable mutex mu_;
  std::map<int64_t, std::vector<Tensor>> versions_ TF_GUARDED_BY(mu_);
  int64_t bytes_ TF_GUARDED_BY(mu_) = 0;
};

class CreateOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    const int64_t capacity = ctx->input(1).scalar<int64_t>()();
    OP_REQUIRES(ctx, capacity >= 1,
                errors::InvalidArgument("weight stash capacity (Nm) must be >= 1, got ",
                                        capacity));
    const ResourceHandle& handle = HandleFromInput(ctx, 0);
    core::RefCountPtr<WeightStash> stash;
    OP_REQUIRES_OK(ctx, LookupOrCreateResource<WeightStash>(
                            ctx, handle, &stash, [capacity](WeightStash** s) {
                              *s = new WeightStash(capacity);
                              return absl::OkStatus();
                            }));
    OP_REQUIRES(ctx, stash->capacity() == capacity,
                errors::AlreadyExists("weight stash '", handle.name(),
                                      "' exists with capacity ", stash->capacity(),
                                      ", not ", capacity));
  }
};

// Base of the kernels that use an existing stash, named by input 0.
class StashKernel : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) final {
    core::RefCountPtr<WeightStash> stash;
    OP_REQUIRES_OK(ctx, hetpipe::LookupNamedResource(ctx, "weight stash", &stash));
    Run(ctx, stash.get(), HandleFromInput(ctx, 0).name());
  }

 protected:
  virtual void Run(OpKernelContext* ctx, WeightStash* stash, const std::string& name) = 0;
  static int64_t Minibatch(OpKernelContext* ctx) { return ctx->input(1).scalar<int64_t>()(); }
};

class PutOp : public StashKernel {
 public:
  using StashKernel::StashKernel;

 protected:
  void Run(OpKernelContext* ctx, WeightStash* stash, const std::string& name) override {
    OpInputList values;
    OP_REQUIRES_OK(ctx, ctx->input_list("values", &values));
    OP_REQUIRES_OK(ctx, stash->Put(name, Minibatch(ctx),
                                   std::vector<Tensor>(values.begin(), values.end())));
  }
};

class GetOp : public StashKernel {
 public:
  explicit GetOp(OpKernelConstruction* ctx) : StashKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dtypes", &dtypes_));
  }

 protected:
  void Run(OpKernelContext* ctx, WeightStash* stash, const std::string& name) override {
    const int64_t minibatch = Minibatch(ctx);
    std::vector<Tensor> values;
    OP_REQUIRES_OK(ctx, stash->Get(name, minibatch, &values));
    OP_REQUIRES(ctx, values.size() == dtypes_.size(),
                errors::InvalidArgument("weight stash '", name, "': minibatch ", minibatch,
                                        " holds ", values.size(), " tensors but ",
                                        dtypes_.size(), " were requested"));
    for (size_t i = 0; i < values.size(); ++i) {
      OP_REQUIRES(ctx, values[i].dtype() == dtypes_[i],
                  errors::InvalidArgument(
                      "weight stash '", name, "': tensor ", i, " of minibatch ", minibatch,
                      " is ", DataTypeString(values[i].dtype()), ", requested ",
                      DataTypeString(dtypes_[i])));
      ctx->set_output(i, values[i]);
    }
  }

 private:
  DataTypeVector dtypes_;
};

class ReleaseOp : public StashKernel {
 public:
  using StashKernel::StashKernel;

 protected:
  void Run(OpKernelContext* ctx, WeightStash* stash, const std::string& name) override {
    OP_REQUIRES_OK(ctx, stash->Release(name, Minibatch(ctx)));
  }
};

class StatsOp : public StashKernel {
 public:
  using StashKernel::StashKernel;

 protected:
  void Run(OpKernelContext* ctx, WeightStash* stash, const std::string& name) override {
    int64_t num = 0, bytes = 0;
    std::vector<int64_t> ids;
    stash->Stats(&num, &bytes, &ids);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = num;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &out));
    out->scalar<int64_t>()() = bytes;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            2, TensorShape({static_cast<int64_t>(ids.size())}), &out));
    for (size_t i = 0; i < ids.size(); ++i) out->vec<int64_t>()(i) = ids[i];
  }
};

// The kernels only hold references to tensors, so the same code serves every
// device; ids, counts and handles live in host memory.
#define HETPIPE_REGISTER_STASH_KERNELS(DEVICE)                                   \
  REGISTER_KERNEL_BUILDER(Name("HetpipeWeightStashHandle")                      \
                              .Device(DEVICE)                                   \
                              .HostMemory("handle"),                            \
                          ResourceHandleOp<WeightStash>);                       \
  REGISTER_KERNEL_BUILDER(Name("HetpipeWeightStashCreate")                      \
                              .Device(DEVICE)                                   \
                              .HostMemory("handle")                             \
                              .HostMemory("capacity"),                          \
                          CreateOp);                                            \
  REGISTER_KERNEL_BUILDER(Name("HetpipeWeightStashPut")                         \
                              .Device(DEVICE)                                   \
                              .HostMemory("handle")                             \
                              .HostMemory("minibatch"),                         \
                          PutOp);                                               \
  REGISTER_KERNEL_BUILDER(Name("HetpipeWeightStashGet")                         \
                              .Device(DEVICE)                                   \
                              .HostMemory("handle")                             \
                              .HostMemory("minibatch"),                         \
                          GetOp);                                               \
  REGISTER_KERNEL_BUILDER(Name("HetpipeWeightStashRelease")                     \
                              .Device(DEVICE)                                   \
                              .HostMemory("handle")                             \
                              .HostMemory("minibatch"),                         \
                          ReleaseOp);                                           \
  REGISTER_KERNEL_BUILDER(Name("HetpipeWeightStashStats")                       \
                              .Device(DEVICE)                                   \
                              .HostMemory("handle")                             \
                              .HostMemory("num_versions")                       \
                              .HostMemory("bytes")                              \
                              .HostMemory("minibatches"),                       \
                          StatsOp);

HETPIPE_REGISTER_STASH_KERNELS(DEVICE_CPU)
HETPIPE_REGISTER_STASH_KERNELS(DEVICE_GPU)

}  // namespace
}  // namespace tensorflow
