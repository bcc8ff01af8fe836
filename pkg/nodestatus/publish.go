package nodestatus

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"reflect"
	"sync"
	"sync/atomic"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/agent"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/kube"
)

// Defaults of Options.
const (
	// DefaultDelay spreads a fleet's writes: 5,000 nodes that change at once (a new
	// configuration) write 500 a second over 10 s, as many as their kubelets' node leases do.
	DefaultDelay = 10 * time.Second
	// pollInterval is how often the agent's state is compared with the status written: a
	// snapshot of counters, no I/O.
	pollInterval = time.Second
	// natInterval is how often the NAT tables' fill is read: a walk of the tables, which takes
	// a while at a million flows.
	natInterval = 30 * time.Second
	// writeTimeout bounds one write; retryMax bounds the backoff of failing ones.
	writeTimeout = 10 * time.Second
	retryMax     = 5 * time.Minute
)

// FieldManager is the agent's name for server-side apply.
const FieldManager = "ip-masq-agent"

// Options configure a Publisher.
type Options struct {
	// Node is the node's name, and so its IPMasqAgentNode's.
	Node string
	// Agent and Backend are read for the status; Source names where the configuration comes
	// from.
	Agent   interface{ Stats() agent.Stats }
	Backend datapath.Backend
	Source  string
	// Reason and Fallback say why the backend runs (backends.Chosen.Reason, CannotRun).
	Reason   string
	Fallback []string
	// Delay is the most a change waits before it is written, and the least time between two
	// writes; zero means DefaultDelay.
	Delay time.Duration
	// Logger receives the publisher's logs; nil discards them.
	Logger *slog.Logger
}

// Publisher writes the node's status when it changes.
type Publisher struct {
	opts  Options
	log   *slog.Logger
	nodes dynamic.ResourceInterface
	core  dynamic.NamespaceableResourceInterface
	// written is the status last written, nil before the first write.
	written *kube.NodeStatus
	// owner is the Node's reference, nil until read; noOwner is set once that failed (and was
	// logged).
	owner   *metav1.OwnerReference
	noOwner bool
	// failing is the reason of the failing writes, as last logged; "" while they succeed.
	failing string
	// Writes that succeeded and failed.
	writes, failures atomic.Uint64

	mu      sync.Mutex
	natFull string // fullTables' last answer
}

// New returns a publisher writing through the API server cfg names; it writes nothing until Run.
func New(cfg *rest.Config, opts Options) (*Publisher, error) {
	if opts.Node == "" {
		return nil, fmt.Errorf("node status: no node name (--node-name, or NODE_NAME from the downward API)")
	}
	if opts.Delay <= 0 {
		opts.Delay = DefaultDelay
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	c, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("node status: API client: %w", err)
	}
	return &Publisher{opts: opts, log: log.With("component", "nodestatus", "node", opts.Node),
		nodes: c.Resource(kube.Nodes.GVR()), core: c.Resource(schema.GroupVersionResource{Version: "v1", Resource: "nodes"})}, nil
}

// Writes returns how many writes of the status succeeded and failed.
func (p *Publisher) Writes() (ok, failed uint64) { return p.writes.Load(), p.failures.Load() }

// Run publishes until ctx is done: it compares the agent's state with the status written every
// pollInterval, and writes a changed one after a random part of Delay, Delay after the previous
// write at the earliest (the first: Delay after the start, by when the first configuration is
// usually in). A failed write is retried, backing off up to retryMax.
func (p *Publisher) Run(ctx context.Context) {
	go p.watchNAT(ctx)
	poll := time.NewTicker(pollInterval)
	defer poll.Stop()
	write := time.NewTimer(time.Hour)
	write.Stop()
	lastWrite, pending, backoff := time.Now(), false, time.Duration(0)
	for {
		select {
		case <-ctx.Done():
			write.Stop()
			return
		case <-poll.C:
			if pending || p.current() == nil {
				continue
			}
			at := max(time.Until(lastWrite.Add(p.opts.Delay)), rand.N(p.opts.Delay))
			write.Reset(at)
			pending = true
		case <-write.C:
			pending = false
			st := p.current()
			if st == nil {
				continue // changed back meanwhile
			}
			if err := p.write(ctx, st); err != nil {
				backoff = min(max(2*backoff, p.opts.Delay), retryMax)
				write.Reset(backoff)
				pending = true
				continue
			}
			lastWrite, backoff = time.Now(), 0
		}
	}
}

// current returns the status to write, nil when it is the one written.
func (p *Publisher) current() *kube.NodeStatus {
	f := facts{stats: p.opts.Agent.Stats(), source: p.opts.Source, reason: p.opts.Reason, fallback: p.opts.Fallback,
		info: datapath.Info{Backend: p.opts.Backend.Name(), AttachMode: datapath.AttachNone}}
	if r, ok := p.opts.Backend.(datapath.InfoReporter); ok {
		f.info = r.Info()
	}
	_, f.nat = p.opts.Backend.(datapath.NATReporter)
	p.mu.Lock()
	f.full = p.natFull
	p.mu.Unlock()
	var conditions []metav1.Condition
	if p.written != nil {
		conditions = p.written.Conditions
	}
	st := build(f, conditions)
	if p.written != nil && reflect.DeepEqual(st, *p.written) {
		return nil
	}
	return &st
}

// watchNAT reads the NAT tables' fill every natInterval, for the NATTableHasRoom condition.
func (p *Publisher) watchNAT(ctx context.Context) {
	nat, ok := p.opts.Backend.(datapath.NATReporter)
	if !ok {
		return
	}
	t := time.NewTicker(natInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		rctx, cancel := context.WithTimeout(ctx, natInterval)
		st, err := nat.NATStats(rctx)
		cancel()
		if err != nil {
			continue // the metrics count failed reads; the condition keeps its last answer
		}
		p.mu.Lock()
		p.natFull = fullTables(st, p.natFull != "")
		p.mu.Unlock()
	}
}

// write applies the status (server-side apply: the object is created when missing, and only
// the agent's own fields are touched), owned by the Node so that it goes away with it.
func (p *Publisher) write(ctx context.Context, st *kube.NodeStatus) error {
	ctx, cancel := context.WithTimeout(ctx, writeTimeout)
	defer cancel()
	obj := map[string]any{"apiVersion": kube.Nodes.APIVersion(), "kind": kube.Nodes.Kind,
		"metadata": p.metadata(ctx), "status": st}
	data, err := json.Marshal(obj)
	if err != nil {
		return err
	}
	force := true
	_, err = p.nodes.Patch(ctx, p.opts.Node, types.ApplyPatchType, data, metav1.PatchOptions{FieldManager: FieldManager, Force: &force})
	if err != nil {
		p.failures.Add(1)
		reason := string(apierrors.ReasonForError(err))
		if reason == "" {
			reason = "NoAnswer" // not the API server's word: it was not reached
		}
		if reason != p.failing {
			p.failing = reason
			attrs := []any{"error", err}
			if apierrors.IsForbidden(err) {
				attrs = append(attrs, "need", "create and patch on "+kube.Nodes.Plural+"."+kube.Group)
			}
			p.log.Warn("cannot write the node's status; retrying", attrs...)
		}
		return err
	}
	if p.written == nil || p.failing != "" {
		p.log.Info("node status written", "object", kube.Nodes.Kind+" "+p.opts.Node, "state", st.State)
	}
	p.failing = ""
	p.writes.Add(1)
	p.written = st
	return nil
}

// metadata is the object's name and, once the Node could be read, its owner reference.
func (p *Publisher) metadata(ctx context.Context) map[string]any {
	md := map[string]any{"name": p.opts.Node, "labels": map[string]any{"app.kubernetes.io/name": "ip-masq-agent"}}
	if p.owner == nil {
		n, err := p.core.Get(ctx, p.opts.Node, metav1.GetOptions{})
		if err != nil {
			if !p.noOwner {
				p.log.Warn("cannot read the Node; its status object is published without an owner, and outlives the node",
					"error", err, "need", "get on nodes")
			}
			p.noOwner = true
			return md
		}
		p.owner = &metav1.OwnerReference{APIVersion: "v1", Kind: "Node", Name: n.GetName(), UID: n.GetUID()}
	}
	md["ownerReferences"] = []metav1.OwnerReference{*p.owner}
	return md
}
