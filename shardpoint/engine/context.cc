#include "shardpoint/engine/context.h"

#include "shardpoint/store/open_store.h"

namespace sp {

Result<std::unique_ptr<EngineContext>> EngineContext::Make(std::string_view path,
                                                           Communicator* comm, Store* store,
                                                           ThreadPool* pool, int threads,
                                                           int coordinator) {
  auto ctx = std::unique_ptr<EngineContext>(new EngineContext());
  if (store == nullptr) {
    SP_ASSIGN_OR_RETURN(ctx->owned_store_, OpenStore(path));
    store = ctx->owned_store_.get();
  }
  if (pool == nullptr) {
    ctx->owned_pool_ = std::make_unique<ThreadPool>(threads > 0 ? threads : DefaultIoThreads());
    pool = ctx->owned_pool_.get();
  }
  if (comm == nullptr) {
    ctx->owned_group_ = std::make_unique<ThreadCommGroup>(1);
    comm = &ctx->owned_group_->comm(0);
  }
  if (coordinator < 0 || coordinator >= comm->size()) {
    return InvalidArgumentError("coordinator rank " + std::to_string(coordinator) +
                                " is outside the group of " + std::to_string(comm->size()));
  }
  ctx->store_ = store;
  ctx->pool_ = pool;
  ctx->comm_ = comm;
  return ctx;
}

}  // namespace sp
