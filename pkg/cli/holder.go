package cli

import (
	"context"
	"fmt"
	"io"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/nodelock"
)

// runHolder says who holds the node lock. With --mine it fails unless the holder is an agent
// of this process's pid namespace, its container's: the DaemonSet's startup probe, which keeps
// a surge rollout's new pod from being found ready (its other probes reach whichever agent
// serves the node's port) before the old agent has handed the node over to it.
func runHolder(_ context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet(commandNamed("holder"), stderr)
	var mine bool
	fs.group("holder", func() {
		fs.BoolVar(&mine, "mine", false, "fail (exit 1) unless the holder is this container's agent (of this pid namespace)")
	})
	if err := parseNoArgs(fs.FlagSet, args); err != nil {
		return err
	}
	h := nodelock.Describe(nodelock.Name)
	held := "the node lock is held by " + h.String()
	if h == (nodelock.Holder{}) {
		held = "nothing holds the node lock @" + nodelock.Name
	}
	if mine && (h.Command != "agent" || h.LocalPid == 0) {
		return fmt.Errorf("%s; this container's agent does not hold it", held)
	}
	fmt.Fprintln(stdout, held)
	return nil
}
