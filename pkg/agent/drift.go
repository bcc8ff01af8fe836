package agent

import (
	"context"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
)

// driftCheckTimeout bounds one drift check, which holds up the loop while it runs (an
// iptables listing may wait for the xtables lock); a check that times out is tried again at
// the next tick. A check takes milliseconds; the bound is for a stuck tool.
const driftCheckTimeout = 5 * time.Second

// checkDrift asks the backend whether what it installed is still in place and records what
// drifted, for the apply that repairs it to count. It tells whether an apply is needed. Nothing
// is checked before the first successful apply, nor while a failed one awaits its retry.
func (a *Agent) checkDrift(ctx context.Context, st *loopState, log *slog.Logger) bool {
	checker, ok := a.opts.Backend.(datapath.DriftChecker)
	if !ok || st.applied == nil || st.failing() {
		return false
	}
	cctx, cancel := context.WithTimeout(ctx, driftCheckTimeout)
	kinds, err := checker.CheckDrift(cctx)
	cancel()
	if err != nil {
		if ctx.Err() == nil && !st.checkFailing {
			log.Warn("drift check failed; trying again at the next one", "error", err)
		}
		st.checkFailing = true
		return false
	}
	if st.checkFailing {
		log.Info("drift check works again")
		st.checkFailing = false
	}
	kinds = a.unenforced(kinds, log)
	if len(kinds) == 0 {
		a.healed(st, nil, log) // repaired by an earlier apply whose own check failed
		st.persisting = ""
		return false
	}
	now := time.Now()
	if st.drift == nil {
		st.drift = map[string]time.Time{}
	}
	for _, k := range kinds {
		if _, ok := st.drift[k]; !ok {
			st.drift[k] = now
		}
	}
	return true
}

// settleDrift runs after an apply while drift was pending: it checks again and counts as healed
// every kind that is in place now. A kind still drifted is logged (once while it persists) and
// left for the next check to try again.
func (a *Agent) settleDrift(ctx context.Context, st *loopState, log *slog.Logger) {
	checker, ok := a.opts.Backend.(datapath.DriftChecker)
	if !ok {
		return
	}
	cctx, cancel := context.WithTimeout(ctx, driftCheckTimeout)
	left, err := checker.CheckDrift(cctx)
	cancel()
	if err != nil {
		return // the next check tells
	}
	left = a.unenforced(left, log)
	a.healed(st, left, log)
	if len(left) == 0 {
		st.persisting = ""
		return
	}
	if s := strings.Join(left, ","); s != st.persisting {
		log.Warn("drift persists after re-applying; trying again at the next check", "what", left)
		st.persisting = s
	}
}

// unenforced records the kinds of drift no apply repairs (datapath.Repairable) among those a
// check found, logs when they change, and returns the others, which an apply repairs.
func (a *Agent) unenforced(kinds []string, log *slog.Logger) []string {
	var repairable, left []string
	for _, k := range kinds {
		if datapath.Repairable(k) {
			repairable = append(repairable, k)
		} else {
			left = append(left, k)
		}
	}
	a.mu.Lock()
	was := a.stats.Unenforced
	a.stats.Unenforced = left
	a.mu.Unlock()
	switch {
	case slices.Equal(was, left):
	case len(left) > 0:
		log.Warn("the policy is not enforced everywhere, and no apply can repair it (the backend's log says where); not ready while it lasts",
			"what", left)
	default:
		log.Info("the policy is enforced everywhere again", "was", was)
	}
	return repairable
}

// healed counts and logs, once each, the pending kinds of drift that are not in left, and
// records left as what persists. Both change under one lock, so Stats never shows a kind as
// healed and still persisting.
func (a *Agent) healed(st *loopState, left []string, log *slog.Logger) {
	var done []string
	a.mu.Lock()
	for _, k := range slices.Sorted(maps.Keys(st.drift)) {
		if slices.Contains(left, k) {
			continue
		}
		if a.stats.Heals == nil {
			a.stats.Heals = map[string]uint64{}
		}
		a.stats.Heals[k]++
		done = append(done, k)
	}
	a.stats.Persisting = slices.Clone(left)
	a.mu.Unlock()
	for _, k := range done {
		log.Warn("drift healed: restored what was changed behind the agent's back", "what", k,
			"took", time.Since(st.drift[k]).Round(time.Millisecond))
		delete(st.drift, k)
	}
}
