package cli

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/agent"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/backends"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/kube"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/nodestatus"
)

// statusFlags say whether and how the agent publishes its node's status (kube.NodeStatus).
type statusFlags struct {
	nodeStatus bool
	nodeName   string
	delay      time.Duration
	heartbeat  time.Duration
}

func (f *statusFlags) register(fs *flag.FlagSet) {
	fs.BoolVar(&f.nodeStatus, "node-status", false, "publish what the agent applied in the status of the node's "+kube.Nodes.Kind+
		" (kubectl get "+kube.Nodes.Plural+"), through the API server of --kubeconfig")
	fs.StringVar(&f.nodeName, "node-name", os.Getenv("NODE_NAME"), "the node's name, for --node-status, its place in the waves of an "+
		kube.Configs.Kind+"'s rollout, and its pods, which source rules with selectors choose (default $NODE_NAME)")
	fs.DurationVar(&f.delay, "node-status-delay", nodestatus.DefaultDelay, "the most a status change waits before it is written, "+
		"and the least time between two writes: a change of every node at once reaches the API server spread over it")
	fs.DurationVar(&f.heartbeat, "node-status-heartbeat", nodestatus.DefaultHeartbeat, "how often the status is written when "+
		"nothing changes (its lastHeartbeatTime), so that a node whose agent is gone shows a stale one: 5,000 nodes write 17 a second at 5m")
}

func (f *statusFlags) check() error {
	if !f.nodeStatus {
		return nil
	}
	if f.nodeName == "" {
		return usageError{fmt.Errorf("node-status: no --node-name, and NODE_NAME is not set")}
	}
	if f.delay <= 0 {
		return usageError{fmt.Errorf("node-status-delay %v: must be positive", f.delay)}
	}
	if f.heartbeat < time.Minute {
		return usageError{fmt.Errorf("node-status-heartbeat %v: must be a minute or more (each node writes once per heartbeat)", f.heartbeat)}
	}
	return nil
}

// publisher returns the node status publisher the flags ask for, nil for none.
func (f *agentFlags) publisher(a *agent.Agent, dp *backends.Chosen, src config.Source, log *slog.Logger) (*nodestatus.Publisher, error) {
	if !f.nodeStatus {
		return nil, nil
	}
	cfg, err := f.restConfig(log)
	if err != nil {
		return nil, fmt.Errorf("node-status: %w", err)
	}
	deleted, _ := src.(config.Deletable)
	return nodestatus.New(cfg, nodestatus.Options{Node: f.nodeName, Agent: a, Backend: dp.Backend, Source: src.String(),
		Reason: dp.Reason, Fallback: dp.CannotRun, Delay: f.delay, Heartbeat: f.heartbeat, Deleted: deleted, Logger: log})
}

// runPublisher runs p until ctx is done, and returns a function that waits for it to stop.
func runPublisher(ctx context.Context, p *nodestatus.Publisher) (wait func()) {
	if p == nil {
		return func() {}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		p.Run(ctx)
	}()
	return func() { <-done }
}
