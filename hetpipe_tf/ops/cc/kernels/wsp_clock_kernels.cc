// Kernels of the Wave Synchronous Parallel clock (HetPipe section 5).
//
// pushed_[w][s] is how many waves stage s of worker w has pushed. A worker's clock is
// the minimum over its stages, the global clock the minimum over workers. A wait for
// wave c completes when the global clock exceeds c. Waiting kernels are asynchronous:
// their `done` callbacks are kept here and called by the push that releases them, or
// by a timer after the timeout, with an error naming the workers that are behind.
// Abort ends a failed run: every wait, now and later, fails at once with its reason,
// so that no virtual worker keeps waiting for a wave that will never be pushed. A worker
// that ended its run (stopped early) is retired: it pushes no more waves, so it no longer
// holds back the global clock (the minimum over the workers still running) until it
// starts its next run.
#include <algorithm>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/env.h"
#include "tensorflow/core/platform/mutex.h"
#include "resource_lookup.h"

namespace tensorflow {
namespace {

class WspClock : public ResourceBase {
 public:
  using Callback = std::function<void(absl::Status, int64_t)>;

  explicit WspClock(std::vector<int64_t> stages_per_worker) {
    for (int64_t n : stages_per_worker) pushed_.emplace_back(n, 0);
    retired_.assign(pushed_.size(), false);
  }

  std::string DebugString() const override {
    mutex_lock l(mu_);
    return absl::StrCat("WspClock(global=", GlobalLocked(), ")");
  }

  absl::Status Push(int64_t worker, int64_t stage, int64_t wave) {
    std::vector<Callback> ready;
    int64_t global;
    {
      mutex_lock l(mu_);
      if (worker < 0 || worker >= static_cast<int64_t>(pushed_.size()) || stage < 0 ||
          stage >= static_cast<int64_t>(pushed_[worker].size())) {
        return errors::InvalidArgument("WSP push from virtual worker ", worker, " stage ", stage,
                                       ", but the clock has ", pushed_.size(), " workers");
      }
      int64_t& next = pushed_[worker][stage];
      if (wave != next) {
        return errors::FailedPrecondition(
            "virtual worker ", worker, " stage ", stage, " pushed wave ", wave, " but its next wave is ",
            next, wave < next ? " (a wave pushed twice would be applied twice)" : " (waves are pushed in order)");
      }
      ++next;
      global = GlobalLocked();
      TakeReleasedLocked(global, &ready);
    }
    for (auto& done : ready) done(absl::OkStatus(), global);
    return absl::OkStatus();
  }

  // Calls done(OK, global) once every worker has pushed `wave`, or done(error) at the timeout.
  void Wait(int64_t wave, double timeout_seconds, Env* env, Callback done) {
    int64_t id = -1;
    int64_t global;
    absl::Status aborted;
    {
      mutex_lock l(mu_);
      global = GlobalLocked();
      aborted = aborted_;
      if (aborted.ok() && wave >= global) {
        id = next_id_++;
        waiters_.emplace(id, Waiter{wave, std::move(done)});
      }
    }
    if (!aborted.ok()) {
      done(aborted, -1);
      return;
    }
    if (id < 0) {  // wave already pushed by every worker (or no wait needed)
      done(absl::OkStatus(), global);
      return;
    }
    Ref();  // the timer holds the clock alive
    env->SchedClosureAfter(static_cast<int64_t>(timeout_seconds * 1e6), [this, id, wave, timeout_seconds]() {
      Callback expired;
      std::string behind;
      {
        mutex_lock l(mu_);
        auto it = waiters_.find(id);
        if (it != waiters_.end()) {
          expired = std::move(it->second.done);
          waiters_.erase(it);
          behind = BehindLocked(wave);
        }
      }
      if (expired) {
        expired(errors::DeadlineExceeded("WSP pull waited ", timeout_seconds,
                                         " s for every virtual worker to push wave ", wave,
                                         "; behind: ", behind),
                -1);
      }
      Unref();
    });
  }

  // Retires worker `worker` (or brings it back) and releases the waits it held back.
  absl::Status Retire(int64_t worker, bool retired) {
    std::vector<Callback> ready;
    int64_t global;
    {
      mutex_lock l(mu_);
      if (worker < 0 || worker >= static_cast<int64_t>(pushed_.size())) {
        return errors::InvalidArgument("WSP retire of virtual worker ", worker, ", but the clock has ",
                                       pushed_.size(), " workers");
      }
      retired_[worker] = retired;
      global = GlobalLocked();
      TakeReleasedLocked(global, &ready);
    }
    for (auto& done : ready) done(absl::OkStatus(), global);
    return absl::OkStatus();
  }

  // Fails every waiting and later wait with `reason`.
  void Abort(const std::string& reason) {
    std::vector<Callback> waiting;
    absl::Status status = errors::Aborted("the WSP run was aborted: ", reason);
    {
      mutex_lock l(mu_);
      if (aborted_.ok()) aborted_ = status;
      for (auto& entry : waiters_) waiting.push_back(std::move(entry.second.done));
      waiters_.clear();
    }
    for (auto& done : waiting) done(status, -1);
  }

  void Stats(std::vector<int64_t>* workers, int64_t* global) const {
    mutex_lock l(mu_);
    workers->clear();
    for (const auto& stages : pushed_) workers->push_back(*std::min_element(stages.begin(), stages.end()));
    *global = GlobalLocked();
  }

 private:
  struct Waiter {
    int64_t wave;
    Callback done;
  };

  // Moves the callbacks of the waits that `global` releases into `ready`.
  void TakeReleasedLocked(int64_t global, std::vector<Callback>* ready) TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      if (it->second.wave < global) {
        ready->push_back(std::move(it->second.done));
        it = waiters_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // The minimum clock over the workers still running (over all when every one is retired).
  int64_t GlobalLocked() const TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    bool all_retired = std::all_of(retired_.begin(), retired_.end(), [](bool r) { return r; });
    int64_t global = -1;
    for (size_t w = 0; w < pushed_.size(); ++w) {
      if (retired_[w] && !all_retired) continue;
      int64_t c = *std::min_element(pushed_[w].begin(), pushed_[w].end());
      global = global < 0 ? c : std::min(global, c);
    }
    return std::max<int64_t>(global, 0);
  }

  std::string BehindLocked(int64_t wave) const TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<std::string> parts;
    for (size_t w = 0; w < pushed_.size(); ++w) {
      if (retired_[w]) continue;
      std::vector<std::string> stages;
      for (size_t s = 0; s < pushed_[w].size(); ++s) {
        if (pushed_[w][s] <= wave) stages.push_back(absl::StrCat(s, " (pushed ", pushed_[w][s], " waves)"));
      }
      if (!stages.empty()) {
        parts.push_back(absl::StrCat("virtual worker ", w, ": stage ", absl::StrJoin(stages, ", stage ")));
      }
    }
    return absl::StrJoin(parts, "; ");
  }

  mutable mutex mu_;
  std::vector<std::vector<int64_t>> pushed_ TF_GUARDED_BY(mu_);
  std::vector<bool> retired_ TF_GUARDED_BY(mu_);
  std::map<int64_t, Waiter> waiters_ TF_GUARDED_BY(mu_);
  int64_t next_id_ TF_GUARDED_BY(mu_) = 0;
  absl::Status aborted_ TF_GUARDED_BY(mu_);
};

class CreateOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    const Tensor& t = ctx->input(1);
    std::vector<int64_t> stages(t.vec<int64_t>().data(), t.vec<int64_t>().data() + t.NumElements());
    OP_REQUIRES(ctx, !stages.empty() && std::all_of(stages.begin(), stages.end(), [](int64_t n) { return n > 0; }),
                errors::InvalidArgument("a WSP clock needs at least one worker, each with at least one stage"));
    core::RefCountPtr<WspClock> clock;
    OP_REQUIRES_OK(ctx, LookupOrCreateResource<WspClock>(ctx, HandleFromInput(ctx, 0), &clock,
                                                         [&stages](WspClock** c) {
                                                           *c = new WspClock(stages);
                                                           return absl::OkStatus();
                                                         }));
  }
};

class PushOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<WspClock> clock;
    OP_REQUIRES_OK(ctx, hetpipe::LookupNamedResource(ctx, "WSP clock", &clock));
    OP_REQUIRES_OK(ctx, clock->Push(ctx->input(1).scalar<int64_t>()(), ctx->input(2).scalar<int64_t>()(),
                                    ctx->input(3).scalar<int64_t>()()));
  }
};

class WaitOp : public AsyncOpKernel {
 public:
  using AsyncOpKernel::AsyncOpKernel;
  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    core::RefCountPtr<WspClock> clock;
    OP_REQUIRES_OK_ASYNC(ctx, hetpipe::LookupNamedResource(ctx, "WSP clock", &clock), done);
    const float timeout = ctx->input(2).scalar<float>()();
    OP_REQUIRES_ASYNC(ctx, timeout > 0, errors::InvalidArgument("WSP wait timeout must be > 0 s, got ", timeout),
                      done);
    clock->Wait(ctx->input(1).scalar<int64_t>()(), timeout, ctx->env(),
                [ctx, done](absl::Status status, int64_t global) {
                  if (status.ok()) {
                    Tensor* out = nullptr;
                    status = ctx->allocate_output(0, TensorShape({}), &out);
                    if (status.ok()) out->scalar<int64_t>()() = global;
                  }
                  ctx->SetStatus(status);
                  done();
                });
  }
};

class AbortOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<WspClock> clock;
    OP_REQUIRES_OK(ctx, hetpipe::LookupNamedResource(ctx, "WSP clock", &clock));
    clock->Abort(ctx->input(1).scalar<tstring>()());
  }
};

class RetireOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<WspClock> clock;
    OP_REQUIRES_OK(ctx, hetpipe::LookupNamedResource(ctx, "WSP clock", &clock));
    OP_REQUIRES_OK(ctx, clock->Retire(ctx->input(1).scalar<int64_t>()(), ctx->input(2).scalar<bool>()()));
  }
};

class StatsOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<WspClock> clock;
    OP_REQUIRES_OK(ctx, hetpipe::LookupNamedResource(ctx, "WSP clock", &clock));
    std::vector<int64_t> workers;
    int64_t global = 0;
    clock->Stats(&workers, &global);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({static_cast<int64_t>(workers.size())}), &out));
    for (size_t i = 0; i < workers.size(); ++i) out->vec<int64_t>()(i) = workers[i];
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &out));
    out->scalar<int64_t>()() = global;
  }
};

REGISTER_KERNEL_BUILDER(Name("HetpipeWspClockHandle").Device(DEVICE_CPU), ResourceHandleOp<WspClock>);
REGISTER_KERNEL_BUILDER(Name("HetpipeWspClockCreate").Device(DEVICE_CPU), CreateOp);
REGISTER_KERNEL_BUILDER(Name("HetpipeWspClockPush").Device(DEVICE_CPU), PushOp);
REGISTER_KERNEL_BUILDER(Name("HetpipeWspClockWait").Device(DEVICE_CPU), WaitOp);
REGISTER_KERNEL_BUILDER(Name("HetpipeWspClockAbort").Device(DEVICE_CPU), AbortOp);
REGISTER_KERNEL_BUILDER(Name("HetpipeWspClockRetire").Device(DEVICE_CPU), RetireOp);
REGISTER_KERNEL_BUILDER(Name("HetpipeWspClockStats").Device(DEVICE_CPU), StatsOp);

}  // namespace
}  // namespace tensorflow
