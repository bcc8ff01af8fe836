package agent

import (
	"context"
	"log/slog"
)

// displace removes the other backends' state, once (see Options.Displace).
func (a *Agent) displace(ctx context.Context, st *loopState, log *slog.Logger) {
	for st.displaced < len(a.opts.Displace) {
		d := a.opts.Displace[st.displaced]
		if err := d.Cleanup(ctx); err != nil {
			log.Warn("cannot remove the other backend's state; retrying after the next apply",
				"other", d.Name(), "error", err)
			return
		}
		log.Info("the other backend's state is removed (backends are exclusive)", "other", d.Name())
		st.displaced++
		if st.displaced == len(a.opts.Displace) {
			// One line for the end, so a reader need not know how many others there are.
			log.Info("no other backend's state is left on the node", "others", len(a.opts.Displace))
		}
	}
}
