// shardpoint's checkpoint management, in one header: retention and gc (manage/retention.h),
// prune (manage/prune.h), diff (manage/diff.h), convert between formats (manage/convert.h) and
// consolidation into Hugging Face safetensors (manage/consolidate.h). Built on the entry points of
// shardpoint/checkpoint.h; docs/DESIGN.md describes the layers.
#ifndef SHARDPOINT_MANAGE_H_
#define SHARDPOINT_MANAGE_H_

#include "shardpoint/checkpoint.h"
#include "shardpoint/manage/consolidate.h"
#include "shardpoint/manage/convert.h"
#include "shardpoint/manage/diff.h"
#include "shardpoint/manage/prune.h"
#include "shardpoint/manage/retention.h"

#endif  // SHARDPOINT_MANAGE_H_
