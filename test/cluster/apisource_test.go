package cluster

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"sigs.k8s.io/yaml"

	"github.com/ip-masq-agent/ip-masq-agent/internal/cluster"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/kube"
)

// apiSource installs the chart reading its configuration from an IPMasqAgentConfig, with node
// statuses and the rollout controller (a Deployment of a non-root pod, with the RBAC the chart
// grants it): the controller completes the object's rollout, the pods' traffic follows the
// object, and `kubectl exec ds/ip-masq-agent -- ip-masq-agent explain` in the agent's pod answers
// with the configuration the agent applied, before and after an edit of the object.
func (w *world) apiSource(ctx context.Context, t *testing.T) {
	v := w.values(backends[2], w.img) // nftables: the backend is not what this checks
	v["configSource"] = "crd"
	v["nodeStatus"] = map[string]any{"enabled": true}
	v["rollout"] = map[string]any{"hold": "5s"}
	helmInstall(t, w.c, v)
	res := dynamic.NewForConfigOrDie(w.c.Config).Resource(kube.Configs.GVR())
	var spec map[string]any
	if err := yaml.Unmarshal([]byte(agentConfig), &spec); err != nil {
		t.Fatal(err)
	}
	obj := &unstructured.Unstructured{Object: map[string]any{"apiVersion": kube.Configs.APIVersion(), "kind": kube.Configs.Kind,
		"metadata": map[string]any{"name": kube.DefaultConfigName}, "spec": spec}}
	if _, err := res.Create(ctx, obj, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitDaemonSet(ctx, t, w.c, Release)
	wait(ctx, t, "the rollout controller available", func() error {
		d, err := w.c.Client.AppsV1().Deployments(Namespace).Get(ctx, Release+"-rollout", metav1.GetOptions{})
		if err != nil {
			return err
		}
		if d.Status.AvailableReplicas != 1 {
			return fmt.Errorf("%d available: %s", d.Status.AvailableReplicas, deploymentWhy(d))
		}
		return nil
	})
	waitRollout := func(gen int64) {
		t.Helper()
		wait(ctx, t, fmt.Sprintf("the rollout of generation %d complete", gen), func() error {
			o, err := res.Get(ctx, kube.DefaultConfigName, metav1.GetOptions{})
			if err != nil {
				return err
			}
			g, _, _ := unstructured.NestedInt64(o.Object, "status", "rollout", "generation")
			phase, _, _ := unstructured.NestedString(o.Object, "status", "rollout", "phase")
			updated, _, _ := unstructured.NestedInt64(o.Object, "status", "rollout", "updated")
			if g != gen || phase != kube.RolloutComplete || updated != 1 {
				return fmt.Errorf("generation %d, %s, %d updated", g, phase, updated)
			}
			return nil
		})
	}
	waitRollout(1)
	w.checkMasquerade(ctx, t, agentConfig)
	w.explainInPod(ctx, t, outsideMasq, "uplink")

	// Keep outsideMasq: the edit goes through the controller to the agent, and explain says so.
	if err := yaml.Unmarshal([]byte(agentConfig), &spec); err != nil {
		t.Fatal(err)
	}
	spec["nonMasqueradeCIDRs"] = append(spec["nonMasqueradeCIDRs"].([]any), outsideMasq.String()+"/32")
	patch, _ := json.Marshal([]map[string]any{{"op": "replace", "path": "/spec", "value": spec}})
	if _, err := res.Patch(ctx, kube.DefaultConfigName, types.JSONPatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	waitRollout(2)
	doc, _ := yaml.Marshal(spec)
	wait(ctx, t, "the edit in the datapath", func() error {
		if got := w.explainInPod(ctx, nil, outsideMasq, ""); got != "pod" {
			return fmt.Errorf("explain in the pod says %s", got)
		}
		return nil
	})
	w.checkMasquerade(ctx, t, string(doc))
	if err := res.Delete(ctx, kube.DefaultConfigName, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	w.uninstall(ctx, t)
	waitNoPods(ctx, t, w.c, "app.kubernetes.io/name=ip-masq-agent-rollout")
}

// explainInPod runs explain for dst in the agent's pod (kubectl exec) and returns its SOURCE
// column; with t, it must be want, and the footer must say that the running agent's
// configuration answered. The table (stdout) and the footer (stderr) are read apart: the two
// streams of kubectl exec interleave mid-line.
func (w *world) explainInPod(ctx context.Context, t *testing.T, dst fmt.Stringer, want string) string {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	cmd := cluster.Namespaces{Net: "/run/netns/" + w.c.Netns}.Command(ctx, filepath.Join(w.c.Bin, "kubectl"),
		"--kubeconfig="+w.c.Kubeconfig, "exec", "-n", Namespace, "ds/"+Release, "--", "ip-masq-agent", "explain", dst.String())
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	got := "?"
	for _, line := range strings.Split(stdout.String(), "\n") {
		if f := strings.Fields(line); len(f) > 2 && f[0] == dst.String() {
			got = f[2] // ADDRESS VERDICT SOURCE ...
		}
	}
	if t != nil {
		t.Helper()
		out := stdout.String() + stderr.String()
		if err != nil || got != want || !strings.Contains(stderr.String(), "config: applied by the running agent") {
			t.Errorf("kubectl exec ds/%s -- ip-masq-agent explain %s: %v, source %s, want %s, from the running agent:\n%s", Release, dst, err, got, want, out)
		} else {
			t.Logf("kubectl exec ds/%s -- ip-masq-agent explain %s:\n%s", Release, dst, out)
		}
	}
	return got
}

// deploymentWhy is a Deployment's conditions, for a wait's error.
func deploymentWhy(d *appsv1.Deployment) string {
	var s []string
	for _, c := range d.Status.Conditions {
		s = append(s, fmt.Sprintf("%s=%s %s", c.Type, c.Status, c.Message))
	}
	return strings.Join(s, "; ")
}
