package rollout

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"strconv"
	"sync"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/kube"
)

// DefaultStatusInterval is the least time between two status writes that change only counts
// (how many nodes applied the generation, which ones a wave waits for): every agent watches the
// object, so each write reaches the whole fleet. Phase and wave changes are written at once.
const DefaultStatusInterval = 10 * time.Second

// FieldManager names the controller's writes.
const FieldManager = "ip-masq-agent-rollout"

// writeTimeout bounds one write to the API server.
const writeTimeout = 10 * time.Second

// Options configure a Controller.
type Options struct {
	// Name is the IPMasqAgentConfig's (kube.DefaultConfigName when empty).
	Name string
	Plan Plan
	// StatusInterval is DefaultStatusInterval when zero.
	StatusInterval time.Duration
	// Logger receives the controller's logs; nil discards them.
	Logger *slog.Logger
}

// Controller rolls each new generation of one IPMasqAgentConfig out in waves: it watches the
// object and every IPMasqAgentNode, and writes the rollout's state to the object's status.
type Controller struct {
	opts    Options
	client  dynamic.Interface
	log     *slog.Logger
	kick    chan struct{}
	configs cache.SharedIndexInformer
	nodes   cache.SharedIndexInformer

	mu        sync.Mutex
	state     *kube.Rollout // the last written (or read) state, for Stats
	lastWrite time.Time
}

// New returns the controller of the object opts names, through the API server cfg names.
func New(cfg *rest.Config, opts Options) (*Controller, error) {
	if opts.Name == "" {
		opts.Name = kube.DefaultConfigName
	}
	if opts.StatusInterval <= 0 {
		opts.StatusInterval = DefaultStatusInterval
	}
	if len(opts.Plan.Waves) == 0 {
		return nil, errors.New("rollout: no waves")
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	client, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("API client: %w", err)
	}
	c := &Controller{opts: opts, client: client, log: log.With("component", "rollout", "config", opts.Name),
		kick: make(chan struct{}, 1)}
	only := dynamicinformer.NewFilteredDynamicSharedInformerFactory(client, 0, "", func(o *metav1.ListOptions) {
		o.FieldSelector = fields.OneTermEqualSelector("metadata.name", opts.Name).String()
	})
	c.configs = only.ForResource(kube.Configs.GVR()).Informer()
	c.nodes = dynamicinformer.NewDynamicSharedInformerFactory(client, 0).ForResource(kube.Nodes.GVR()).Informer()
	kick := cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { c.trigger() },
		UpdateFunc: func(any, any) { c.trigger() },
		DeleteFunc: func(any) { c.trigger() },
	}
	for _, inf := range []cache.SharedIndexInformer{c.configs, c.nodes} {
		if _, err := inf.AddEventHandler(kick); err != nil {
			return nil, err
		}
	}
	return c, nil
}

func (c *Controller) trigger() {
	select {
	case c.kick <- struct{}{}:
	default:
	}
}

// Run watches and steps the rollout until ctx ends.
func (c *Controller) Run(ctx context.Context) error {
	go c.configs.RunWithContext(ctx)
	go c.nodes.RunWithContext(ctx)
	if !cache.WaitForCacheSync(ctx.Done(), c.configs.HasSynced, c.nodes.HasSynced) {
		return ctx.Err()
	}
	c.log.Info("watching the configuration and the nodes", "waves", c.opts.Plan.Waves, "hold", c.opts.Plan.Hold,
		"deadline", c.opts.Plan.Deadline, "immediate", c.opts.Plan.Immediate)
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-c.kick:
		case <-timer.C:
		}
		wait := c.step(ctx)
		timer.Stop()
		if wait > 0 {
			timer.Reset(wait)
		}
	}
}

// step reads the object and the nodes, steps the plan, and writes what changed. It returns how
// long until the next step is due without an event.
func (c *Controller) step(ctx context.Context) time.Duration {
	item, exists, err := c.configs.GetStore().GetByKey(c.opts.Name)
	if err != nil || !exists {
		return 0 // nothing to roll out; its creation is an event
	}
	obj := item.(*unstructured.Unstructured)
	o, err := ObjectOf(obj)
	if err != nil {
		c.log.Error("cannot read the object's status; nothing is written until it is fixed", "error", err)
		return 0
	}
	var nodes []Node
	for _, it := range c.nodes.GetStore().List() {
		n, err := nodeOf(it.(*unstructured.Unstructured))
		if err != nil {
			c.log.Warn("a node's status does not read; it counts as a node that has not applied the generation", "error", err)
		}
		nodes = append(nodes, n)
	}
	now := time.Now()
	next, wait, resumed := c.opts.Plan.Step(o, nodes, now)
	if resumed {
		c.unannotate(ctx)
	}
	if reflect.DeepEqual(next, o.Rollout) {
		c.setState(next)
		return wait
	}
	if o.Rollout != nil && countsOnly(*o.Rollout, *next) {
		if left := c.opts.StatusInterval - now.Sub(c.lastWritten()); left > 0 {
			return minPositive(wait, left)
		}
	}
	if err := c.write(ctx, obj, next); err != nil {
		if apierrors.IsConflict(err) {
			return 0 // the write that won is an event
		}
		c.log.Warn("cannot write the rollout's state; trying again", "error", err)
		return minPositive(wait, time.Second)
	}
	c.logChange(o.Rollout, next)
	c.setState(next)
	return wait
}

// countsOnly tells whether b differs from a only in the counts of nodes, and, while a wave is
// out, in what it waits for.
func countsOnly(a, b kube.Rollout) bool {
	a.Nodes, a.Updated = b.Nodes, b.Updated
	if a.Phase == kube.RolloutProgressing && b.Phase == kube.RolloutProgressing {
		a.Reason = b.Reason
	}
	return reflect.DeepEqual(a, b)
}

func minPositive(a, b time.Duration) time.Duration {
	if a <= 0 || b < a {
		return b
	}
	return a
}

// write replaces the object's status with the rollout's state; the object's resourceVersion
// makes it fail (a conflict) if the object changed since it was read.
func (c *Controller) write(ctx context.Context, obj *unstructured.Unstructured, r *kube.Rollout) error {
	st, err := toMap(kube.ConfigObjectStatus{Rollout: r})
	if err != nil {
		return err
	}
	obj = obj.DeepCopy()
	obj.Object["status"] = st
	ctx, cancel := context.WithTimeout(ctx, writeTimeout)
	defer cancel()
	_, err = c.client.Resource(kube.Configs.GVR()).UpdateStatus(ctx, obj, metav1.UpdateOptions{FieldManager: FieldManager})
	if err == nil {
		c.mu.Lock()
		c.lastWrite = time.Now()
		c.mu.Unlock()
	}
	return err
}

// unannotate removes the resume annotation the step acted on, so that it resumes nothing later.
func (c *Controller) unannotate(ctx context.Context) {
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]any{kube.ResumeAnnotation: nil}}})
	ctx, cancel := context.WithTimeout(ctx, writeTimeout)
	defer cancel()
	if _, err := c.client.Resource(kube.Configs.GVR()).Patch(ctx, c.opts.Name, types.MergePatchType, patch,
		metav1.PatchOptions{FieldManager: FieldManager}); err != nil {
		c.log.Warn("cannot remove the resume annotation; remove it by hand", "annotation", kube.ResumeAnnotation, "error", err)
	}
}

// logChange logs a change of phase or wave.
func (c *Controller) logChange(was, now *kube.Rollout) {
	attrs := []any{"generation", now.Generation, "wave", fmt.Sprintf("%d/%d", now.Wave, now.Waves),
		"updated", fmt.Sprintf("%d/%d", now.Updated, now.Nodes), "reason", now.Reason}
	switch {
	case now.Phase == kube.RolloutHalted && (was == nil || was.Phase != kube.RolloutHalted || was.Generation != now.Generation):
		c.log.Warn("rollout halted: the nodes not released keep the stable configuration", append(attrs,
			"stable", now.Stable.Generation, "resume", fmt.Sprintf("kubectl annotate %s %s %s=%d", kube.Configs.Plural, c.opts.Name,
				kube.ResumeAnnotation, now.Generation))...)
	case now.Phase == kube.RolloutComplete && (was == nil || was.Phase != kube.RolloutComplete || was.Generation != now.Generation):
		c.log.Info("rollout complete: every node applies the generation", attrs...)
	case was == nil || was.Generation != now.Generation || was.Wave != now.Wave:
		c.log.Info("rollout: wave released", attrs...)
	}
}

func (c *Controller) lastWritten() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.lastWrite
}

func (c *Controller) setState(r *kube.Rollout) {
	c.mu.Lock()
	c.state = r
	c.mu.Unlock()
}

// State is the rollout's state as last written or read; nil before the first step.
func (c *Controller) State() *kube.Rollout {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.state
}

// ObjectOf reads an IPMasqAgentConfig as the controller and the agents see it: its generation,
// its spec as JSON, its rollout and the resume annotation.
func ObjectOf(obj *unstructured.Unstructured) (Object, error) {
	o := Object{Generation: obj.GetGeneration()}
	if v, ok := obj.Object["spec"]; ok && v != nil {
		spec, err := json.Marshal(v)
		if err != nil {
			return o, err
		}
		o.Spec = spec
	}
	var st kube.ConfigObjectStatus
	if err := fromMap(obj.Object["status"], &st); err != nil {
		return o, fmt.Errorf("status: %w", err)
	}
	o.Rollout = st.Rollout
	if v, ok := obj.GetAnnotations()[kube.ResumeAnnotation]; ok {
		o.Resume, _ = strconv.ParseInt(v, 10, 64) // not a number resumes nothing
	}
	return o, nil
}

// nodeOf reads a node's IPMasqAgentNode.
func nodeOf(obj *unstructured.Unstructured) (Node, error) {
	n := Node{Name: obj.GetName()}
	return n, fromMap(obj.Object["status"], &n.Status)
}

func fromMap(v any, out any) error {
	if v == nil {
		return nil
	}
	raw, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return json.Unmarshal(raw, out)
}

func toMap(v any) (map[string]any, error) {
	raw, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	var m map[string]any
	return m, json.Unmarshal(raw, &m)
}
