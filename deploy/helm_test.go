package deploy

import (
	"fmt"
	"io"
	"log"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"sort"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
	"helm.sh/helm/v3/pkg/releaseutil"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"
)

// The chart is rendered through the helm library (what `helm template` runs) and compared, object
// for object, with the kustomize manifests, which stay the reference: a field either differs in
// both or in neither.

const (
	chartDir  = "helm/ip-masq-agent"
	namespace = "kube-system"
	hookKey   = "helm.sh/hook"
)

// object is one manifest as generic JSON, what the API server receives.
type object = map[string]any

// objects are manifests by kind, namespace and name.
type objects map[string]object

func objectKey(o object) string {
	meta, _ := o["metadata"].(map[string]any)
	return fmt.Sprintf("%v %v/%v", o["kind"], meta["namespace"], meta["name"])
}

func (os objects) add(t *testing.T, where string, doc []byte) {
	t.Helper()
	if strings.TrimSpace(string(doc)) == "" {
		return
	}
	// Strictly into the API types first: an unknown or misplaced field fails here.
	if _, err := decode(doc); err != nil {
		t.Fatalf("%s: %v\n%s", where, err, doc)
	}
	var o object
	if err := yaml.Unmarshal(doc, &o); err != nil {
		t.Fatalf("%s: %v", where, err)
	}
	k := objectKey(o)
	if _, dup := os[k]; dup {
		t.Fatalf("%s: %s twice", where, k)
	}
	os[k] = o
}

// kustomize builds a kustomization directory with kustomize itself (its library; what kubectl
// apply -k runs).
func kustomize(t *testing.T, dir string) objects {
	t.Helper()
	res, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		t.Fatal(err)
	}
	out := objects{}
	for _, r := range res.Resources() {
		doc, err := r.AsYAML()
		if err != nil {
			t.Fatal(err)
		}
		out.add(t, dir+": "+r.CurId().String(), doc)
	}
	return out
}

// helmTemplate renders the chart with values over its defaults, as `helm template --namespace
// kube-system` does: the release's objects, and its hooks' objects.
func helmTemplate(t *testing.T, values map[string]any) (release, hooks objects, err error) {
	t.Helper()
	chart := loadChart(t)
	install := action.NewInstall(&action.Configuration{Log: func(string, ...any) {}})
	install.DryRun, install.ClientOnly, install.Replace, install.IncludeCRDs = true, true, true, true
	install.ReleaseName, install.Namespace = "ip-masq-agent", namespace
	rel, err := install.Run(chart, values)
	if err != nil {
		return nil, nil, err
	}
	release, hooks = objects{}, objects{}
	for name, doc := range releaseutil.SplitManifests(rel.Manifest) {
		release.add(t, name, []byte(doc))
	}
	for _, h := range rel.Hooks {
		hooks.add(t, h.Path, []byte(h.Manifest))
	}
	return release, hooks, nil
}

// loadChart loads the chart as helm does. The loader logs a notice for the one symbolic link,
// files/grafana-dashboard.json, which is deploy/monitoring's dashboard (its one copy); that
// notice is expected, and kept out of the test's output.
func loadChart(t *testing.T) *chart.Chart {
	t.Helper()
	out := log.Writer()
	log.SetOutput(io.Discard)
	defer log.SetOutput(out)
	c, err := loader.Load(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// diff describes how got and want differ, object by object.
func diff(got, want objects) string {
	var out []string
	for _, k := range slices.Sorted(maps.Keys(want)) {
		g, ok := got[k]
		if !ok {
			out = append(out, "missing "+k)
			continue
		}
		if !reflect.DeepEqual(g, want[k]) {
			gy, _ := yaml.Marshal(g)
			wy, _ := yaml.Marshal(want[k])
			out = append(out, fmt.Sprintf("%s differs:\n--- rendered\n%s--- want\n%s", k, gy, wy))
		}
	}
	for _, k := range slices.Sorted(maps.Keys(got)) {
		if _, ok := want[k]; !ok {
			out = append(out, "unexpected "+k)
		}
	}
	return strings.Join(out, "\n")
}

// at walks a generic object: map keys and list indexes; nil where the path leads nowhere.
func at(o any, path ...any) any {
	for _, p := range path {
		switch k := p.(type) {
		case string:
			m, _ := o.(map[string]any)
			o = m[k]
		case int:
			l, _ := o.([]any)
			if k >= len(l) {
				return nil
			}
			o = l[k]
		}
	}
	return o
}

// set writes value at path (the last step a map key or a list index).
func set(o any, value any, path ...any) {
	parent := at(o, path[:len(path)-1]...)
	switch k := path[len(path)-1].(type) {
	case string:
		parent.(map[string]any)[k] = value
	case int:
		parent.([]any)[k] = value
	}
}

// generic converts YAML to the generic form the objects have.
func generic(t *testing.T, doc string) any {
	t.Helper()
	var v any
	if err := yaml.Unmarshal([]byte(doc), &v); err != nil {
		t.Fatal(err)
	}
	return v
}

// hooked is the cleanup DaemonSet as the chart's post-delete hook.
func hooked(cleanup objects) objects {
	for _, o := range cleanup {
		o["metadata"].(map[string]any)["annotations"] = map[string]any{hookKey: "post-delete", "helm.sh/hook-delete-policy": "before-hook-creation"}
	}
	return cleanup
}

// expected are the kustomize manifests the chart renders with its default values: the base as
// the release, the cleanup DaemonSet as its hook.
func expected(t *testing.T) (release, hooks objects) {
	return kustomize(t, "base"), hooked(kustomize(t, "cleanup"))
}

// secured makes the kustomize manifests what the chart renders with metrics.secure, its
// default: the agent's service account (../rbac/status) and ../rbac/metrics (its scraper account
// only beside a PodMonitor, which scrapes with it), --metrics-secure after --metrics-address, and
// the probes over HTTPS. The kustomize base serves plain HTTP: it never talks to the API server.
func secured(t *testing.T, r objects) {
	t.Helper()
	sa := "ServiceAccount " + namespace + "/ip-masq-agent"
	if _, ok := r[sa]; !ok {
		r[sa] = kustomize(t, "rbac/status")[sa]
	}
	_, podMonitor := r["PodMonitor "+namespace+"/ip-masq-agent"]
	for k, o := range kustomize(t, "rbac/metrics") {
		if podMonitor || !strings.Contains(k, "-scraper") {
			r[k] = o
		}
	}
	ds := r[agentDS]
	set(ds, true, pod("automountServiceAccountToken")...)
	set(ds, "ip-masq-agent", pod("serviceAccountName")...)
	set(ds, "ip-masq-agent", pod("serviceAccount")...)
	args := at(ds, pod("containers", 0, "args")...).([]any)
	if !strings.HasPrefix(args[3].(string), "--metrics-address=") {
		t.Fatalf("args[3] = %q, want --metrics-address", args[3])
	}
	set(ds, slices.Insert(slices.Clone(args), 4, any("--metrics-secure")), pod("containers", 0, "args")...)
	for _, probe := range []string{"livenessProbe", "readinessProbe"} {
		set(ds, "HTTPS", pod("containers", 0, probe, "httpGet", "scheme")...)
	}
	if d, ok := r["Deployment "+namespace+"/ip-masq-agent-rollout"]; ok {
		args := at(d, pod("containers", 0, "args")...).([]any)
		if !strings.HasPrefix(args[5].(string), "--metrics-address=") {
			t.Fatalf("the rollout controller's args[5] = %q, want --metrics-address", args[5])
		}
		set(d, slices.Insert(slices.Clone(args), 6, any("--metrics-secure")), pod("containers", 0, "args")...)
		set(d, "HTTPS", pod("containers", 0, "livenessProbe", "httpGet", "scheme")...)
	}
	for _, name := range []string{"ip-masq-agent", "ip-masq-agent-rollout"} {
		if pm, ok := r["PodMonitor "+namespace+"/"+name]; ok {
			ep := at(pm, "spec", "podMetricsEndpoints", 0).(map[string]any)
			ep["scheme"] = "https"
			ep["tlsConfig"] = generic(t, "{insecureSkipVerify: true}")
			ep["authorization"] = generic(t, "{type: Bearer, credentials: {name: ip-masq-agent-metrics-scraper, key: token}}")
		}
	}
}

// The chart's defaults render the kustomize base, with the metrics secured.
func TestChartDefaultsAreTheKustomizeBase(t *testing.T) {
	release, hooks, err := helmTemplate(t, nil)
	if err != nil {
		t.Fatal(err)
	}
	wantRelease, wantHooks := expected(t)
	secured(t, wantRelease)
	if d := diff(release, wantRelease); d != "" {
		t.Errorf("helm template against deploy/base:\n%s", d)
	}
	if d := diff(hooks, wantHooks); d != "" {
		t.Errorf("the chart's hooks against deploy/cleanup:\n%s", d)
	}
}

// The two DaemonSets, and the path of their pod spec.
var (
	agentDS   = "DaemonSet " + namespace + "/ip-masq-agent"
	cleanupDS = "DaemonSet " + namespace + "/ip-masq-agent-cleanup"
	podSpec   = []any{"spec", "template", "spec"}
)

func pod(path ...any) []any { return append(slices.Clone(podSpec), path...) }

// Each value of values.yaml changes what it should, and nothing else: the render with the value
// set equals the kustomize manifests changed by hand in the same way.
func TestChartValues(t *testing.T) {
	type change func(t *testing.T, release, hooks objects)
	images := func(image string) change {
		return func(t *testing.T, r, h objects) {
			set(r[agentDS], image, pod("containers", 0, "image")...)
			set(h[cleanupDS], image, pod("initContainers", 0, "image")...)
			set(h[cleanupDS], image, pod("containers", 0, "image")...)
		}
	}
	bothPods := func(value any, path ...any) change {
		return func(t *testing.T, r, h objects) {
			set(r[agentDS], value, pod(path...)...)
			set(h[cleanupDS], value, pod(path...)...)
		}
	}
	monitoring := func(keep string, edit func(o object)) change {
		return func(t *testing.T, r, h objects) {
			for k, o := range kustomize(t, "monitoring") {
				if strings.HasPrefix(k, keep) {
					if edit != nil {
						edit(o)
					}
					r[k] = o
				}
			}
		}
	}
	repo := strings.Split(at(kustomize(t, "base")[agentDS], pod("containers", 0, "image")...).(string), ":")[0]
	tests := []struct {
		name   string
		values string
		// covers are the values.yaml leaves the case sets.
		covers []string
		want   change
	}{
		{"config", "config: 'masqOutBound: false'", []string{"config"}, func(t *testing.T, r, h objects) {
			set(r["ConfigMap "+namespace+"/ip-masq-agent"], "masqOutBound: false\n", "data", "config")
		}},
		// The user's ConfigMap merged with the chart's renders the overlay that projects both.
		{"extra config maps", "extraConfigMaps: [ip-masq-agent-user]", []string{"extraConfigMaps"}, func(t *testing.T, r, h objects) {
			maps.Copy(r, kustomize(t, "overlays/config-directory"))
		}},
		{"extra config maps named otherwise", "extraConfigMaps: [team-a]", []string{"extraConfigMaps"}, func(t *testing.T, r, h objects) {
			maps.Copy(r, kustomize(t, "overlays/config-directory"))
			set(r[agentDS], "team-a", pod("volumes", 0, "projected", "sources", 1, "configMap", "name")...)
			set(r[agentDS], "ip-masq-team-a", pod("volumes", 0, "projected", "sources", 1, "configMap", "items", 0, "path")...)
		}},
		{"image repository", "image: {repository: registry.example/ipm}", []string{"image.repository"}, images("registry.example/ipm:" + release(t))},
		{"image tag", "image: {tag: v9.9.9}", []string{"image.tag"}, images(repo + ":v9.9.9")},
		{"image pull policy", "image: {pullPolicy: Always}", []string{"image.pullPolicy"}, func(t *testing.T, r, h objects) {
			set(r[agentDS], "Always", pod("containers", 0, "imagePullPolicy")...)
			set(h[cleanupDS], "Always", pod("initContainers", 0, "imagePullPolicy")...)
			set(h[cleanupDS], "Always", pod("containers", 0, "imagePullPolicy")...)
		}},
		{"backend", "backend: iptables", []string{"backend"}, func(t *testing.T, r, h objects) {
			set(r[agentDS], "--backend=iptables", pod("containers", 0, "args", 1)...)
		}},
		{"extra args", "extraArgs: [--enable-ipv6, --to-ports=32768-65535]", []string{"extraArgs"}, func(t *testing.T, r, h objects) {
			args := at(r[agentDS], pod("containers", 0, "args")...).([]any)
			set(r[agentDS], append(args, "--enable-ipv6", "--to-ports=32768-65535"), pod("containers", 0, "args")...)
		}},
		{"surge", "updateStrategy: {maxSurge: 1, maxUnavailable: 0}", []string{"updateStrategy.maxSurge", "updateStrategy.maxUnavailable"}, func(t *testing.T, r, h objects) {
			set(r[agentDS], generic(t, "{maxSurge: 1, maxUnavailable: 0}"), "spec", "updateStrategy", "rollingUpdate")
		}},
		// Maps of values merge with the defaults, as every helm value does (null removes a key).
		{"resources", "resources: {requests: {cpu: 50m, memory: null}, limits: {memory: 512Mi}}", []string{"resources"}, func(t *testing.T, r, h objects) {
			set(r[agentDS], generic(t, "{requests: {cpu: 50m}, limits: {memory: 512Mi}}"), pod("containers", 0, "resources")...)
		}},
		{"tolerations", "tolerations: [{key: dedicated, operator: Equal, value: edge, effect: NoSchedule}]", []string{"tolerations"},
			bothPods(generic(t, "[{key: dedicated, operator: Equal, value: edge, effect: NoSchedule}]"), "tolerations")},
		{"priority class", "priorityClassName: node-agents", []string{"priorityClassName"}, bothPods("node-agents", "priorityClassName")},
		// The handbook's opt-in label, as a value, renders the overlay that adds it; the cleanup
		// hook follows the agent.
		{"node selector", `nodeSelector: {beta.kubernetes.io/masq-agent-ds-ready: "true"}`, []string{"nodeSelector"}, func(t *testing.T, r, h objects) {
			maps.Copy(r, kustomize(t, "overlays/masq-agent-ds-ready"))
			set(h[cleanupDS], at(r[agentDS], pod("nodeSelector")...), pod("nodeSelector")...)
		}},
		// SYS_RESOURCE for kernels before 5.11, as the overlay adds it; the cleanup hook has the
		// agent's capabilities.
		{"memlock", "memlock: true", []string{"memlock"}, func(t *testing.T, r, h objects) {
			maps.Copy(r, kustomize(t, "overlays/memlock"))
			set(h[cleanupDS], at(r[agentDS], pod("containers", 0, "securityContext", "capabilities")...), pod("initContainers", 0, "securityContext", "capabilities")...)
		}},
		{"seccomp profile", "seccompProfile: {type: Localhost, localhostProfile: ip-masq-agent.json}", []string{"seccompProfile"},
			bothPods(generic(t, "{type: Localhost, localhostProfile: ip-masq-agent.json}"), "securityContext", "seccompProfile")},
		{"metrics port", "metrics: {port: 9100}", []string{"metrics.port"}, func(t *testing.T, r, h objects) {
			set(r[agentDS], "--metrics-address=:9100", pod("containers", 0, "args", 3)...)
			set(r[agentDS], float64(9100), pod("containers", 0, "livenessProbe", "httpGet", "port")...)
			set(r[agentDS], float64(9100), pod("containers", 0, "readinessProbe", "httpGet", "port")...)
			set(r["Service "+namespace+"/ip-masq-agent-metrics"], float64(9100), "spec", "ports", 0, "port")
			set(r["Service "+namespace+"/ip-masq-agent-metrics"], float64(9100), "spec", "ports", 0, "targetPort")
		}},
		{"no metrics service", "metrics: {service: {enabled: false}}", []string{"metrics.service.enabled"}, func(t *testing.T, r, h objects) {
			delete(r, "Service "+namespace+"/ip-masq-agent-metrics")
		}},
		{"pod monitor", "metrics: {podMonitor: {enabled: true}}", []string{"metrics.podMonitor.enabled"}, monitoring("PodMonitor", nil)},
		// Plain HTTP renders the kustomize base as it is, its PodMonitor too.
		{"plain metrics", "metrics: {secure: false}", []string{"metrics.secure"}, func(t *testing.T, r, h objects) {}},
		{"pod monitor of plain metrics", "metrics: {secure: false, podMonitor: {enabled: true}}", []string{"metrics.secure"}, monitoring("PodMonitor", nil)},
		{"pod monitor interval", "metrics: {podMonitor: {enabled: true, interval: 10s}}", []string{"metrics.podMonitor.interval"},
			monitoring("PodMonitor", func(o object) { set(o, "10s", "spec", "podMetricsEndpoints", 0, "interval") })},
		{"dashboard", "metrics: {dashboard: {enabled: true}}", []string{"metrics.dashboard.enabled"}, monitoring("ConfigMap", nil)},
		{"prometheus rule", "metrics: {prometheusRule: {enabled: true}}", []string{"metrics.prometheusRule.enabled"}, monitoring("PrometheusRule", nil)},
		// The configuration from the API server, and each node's status: the overlay, RBAC and all.
		{"config from the API server", "{configSource: configmap, nodeStatus: {enabled: true}}", []string{"configSource", "nodeStatus.enabled"},
			func(t *testing.T, r, h objects) { maps.Copy(r, kustomize(t, "overlays/api-server")) }},
		{"pods of source rules", "{configSource: configmap, nodeStatus: {enabled: true}, podSelectors: {enabled: true}}", []string{"podSelectors.enabled"},
			func(t *testing.T, r, h objects) {
				maps.Copy(r, kustomize(t, "overlays/api-server"))
				maps.Copy(r, kustomize(t, "rbac/pods"))
			}},
		{"config from an IPMasqAgentConfig", "{configSource: crd, nodeStatus: {enabled: true}}", []string{"configSource", "nodeStatus.enabled"},
			func(t *testing.T, r, h objects) {
				clear(r)
				maps.Copy(r, kustomize(t, "overlays/api-server-crd"))
			}},
		{"config from an IPMasqAgentConfig without the rollout controller", "{configSource: crd, nodeStatus: {enabled: true}, rollout: {enabled: false}}",
			[]string{"rollout.enabled"}, func(t *testing.T, r, h objects) {
				clear(r)
				maps.Copy(r, kustomize(t, "overlays/api-server-crd"))
				for k := range kustomize(t, "rollout") {
					delete(r, k)
				}
			}},
		{"rollout waves", "{configSource: crd, nodeStatus: {enabled: true}, rollout: {waves: '20,100', hold: 30s, deadline: 1h}}",
			[]string{"rollout.waves", "rollout.hold", "rollout.deadline"}, func(t *testing.T, r, h objects) {
				clear(r)
				maps.Copy(r, kustomize(t, "overlays/api-server-crd"))
				args := at(r["Deployment "+namespace+"/ip-masq-agent-rollout"], pod("containers", 0, "args")...).([]any)
				args[2], args[3], args[4] = "--waves=20,100", "--hold=30s", "--deadline=1h"
			}},
		{"no admission policy", "admissionPolicy: {enabled: false}", []string{"admissionPolicy.enabled"}, func(t *testing.T, r, h objects) {
			for _, name := range []string{"ip-masq-agent-configmap", "ip-masq-agent-config"} {
				delete(r, "ValidatingAdmissionPolicy <nil>/"+name)
				delete(r, "ValidatingAdmissionPolicyBinding <nil>/"+name)
			}
		}},
		{"no cleanup hook", "cleanup: {enabled: false}", []string{"cleanup.enabled"}, func(t *testing.T, r, h objects) {
			clear(h)
		}},
	}
	covered := map[string]bool{}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var values map[string]any
			if err := yaml.Unmarshal([]byte(tt.values), &values); err != nil {
				t.Fatal(err)
			}
			release, hooks, err := helmTemplate(t, values)
			if err != nil {
				t.Fatal(err)
			}
			wantRelease, wantHooks := expected(t)
			tt.want(t, wantRelease, wantHooks)
			if m, _ := values["metrics"].(map[string]any); m["secure"] != false {
				secured(t, wantRelease)
			}
			if d := diff(release, wantRelease); d != "" {
				t.Errorf("%s:\n%s", tt.values, d)
			}
			if d := diff(hooks, wantHooks); d != "" {
				t.Errorf("%s, hooks:\n%s", tt.values, d)
			}
		})
		for _, c := range tt.covers {
			covered[c] = true
		}
	}
	defaults, err := chartutil.ReadValuesFile(filepath.Join(chartDir, "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, leaf := range leaves("", defaults) {
		if !covered[leaf] {
			t.Errorf("value %s has no case", leaf)
		}
	}
}

// wholeValues are the maps of values.yaml that are one Kubernetes field each, so one leaf.
var wholeValues = []string{"resources", "nodeSelector", "seccompProfile"}

// leaves lists the paths of a values tree's leaves (lists count as leaves).
func leaves(prefix string, v map[string]any) []string {
	var out []string
	for k, child := range v {
		path := strings.TrimPrefix(prefix+"."+k, ".")
		if m, ok := child.(map[string]any); ok && len(m) > 0 && !slices.Contains(wholeValues, path) {
			out = append(out, leaves(path, m)...)
			continue
		}
		out = append(out, path)
	}
	sort.Strings(out)
	return out
}

// Values that cannot work are refused when rendering, by the chart's schema.
func TestChartRefusesBadValues(t *testing.T) {
	for _, tt := range []struct{ values, want string }{
		{"backend: ebpf", "backend"},
		{"metrics: {port: 0}", "port"},
		{"extraArgs: [enable-ipv6]", "extraArgs"},
		{"extraConfigMaps: [Not/A/Name]", "extraConfigMaps"},
		{"seccompProfile: {type: Default}", "seccompProfile"},
		{"imag: {tag: v1}", "imag"},
		// Without node statuses the controller would see no node, and release every generation
		// to all at once.
		{"configSource: crd", "needs nodeStatus.enabled"},
		// From a file the agent rejects a configuration whose rules select by labels.
		{"config: 'sourceRules: [{name: a, cidrs: [10.1.0.0/16]}, {name: batch, podSelector: {}}]'", "source rule batch selects pods by labels, which needs the API server"},
		{"{configSource: configmap, config: 'sourceRules: [{name: batch, namespaceSelector: {}}]'}", "set podSelectors.enabled=true"},
		{"podSelectors: {enabled: true}", "podSelectors.enabled needs configSource"},
	} {
		var values map[string]any
		if err := yaml.Unmarshal([]byte(tt.values), &values); err != nil {
			t.Fatal(err)
		}
		if _, _, err := helmTemplate(t, values); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: %v, want an error naming %s", tt.values, err, tt.want)
		}
	}
}

// Source rules are the agent's to judge: the chart renders them as written, those of cidrs from
// any source, those of selectors where the agent reads the API server.
func TestChartTakesSourceRules(t *testing.T) {
	for _, values := range []string{
		"config: 'sourceRules: [{name: pool-b, cidrs: [10.244.128.0/17], masqOutBound: false}]'",
		"{configSource: configmap, podSelectors: {enabled: true}, config: 'sourceRules: [{name: batch, podSelector: {matchLabels: {workload: batch}}}]'}",
		// Null selectors are absent ones, to the agent too.
		"config: 'sourceRules: [{name: a, cidrs: [10.1.0.0/16], podSelector: null}]'",
		// Not YAML the chart reads: the agent says what is wrong.
		"config: 'sourceRules: {name: a}'",
	} {
		var v map[string]any
		if err := yaml.Unmarshal([]byte(values), &v); err != nil {
			t.Fatal(err)
		}
		r, _, err := helmTemplate(t, v)
		if err != nil {
			t.Errorf("%s: %v", values, err)
			continue
		}
		cm, ok := r["ConfigMap kube-system/ip-masq-agent"]
		if !ok {
			t.Errorf("%s: no ConfigMap ip-masq-agent among %v", values, slices.Sorted(maps.Keys(r)))
			continue
		}
		if got, want := at(cm, "data", "config"), v["config"].(string)+"\n"; got != want {
			t.Errorf("%s: config %q, want %q", values, got, want)
		}
		// The pod watcher follows the node's pods: the agent is told its node.
		if pods, _ := v["podSelectors"].(map[string]any); pods["enabled"] == true {
			env, _ := at(r[agentDS], pod("containers", 0, "env")...).([]any)
			if !slices.ContainsFunc(env, func(e any) bool { return at(e, "name") == "NODE_NAME" }) {
				t.Errorf("%s: no NODE_NAME among %v", values, env)
			}
		}
	}
}

// helm lint finds nothing to warn about; its only remark is that the chart has no icon (the
// project has none).
func TestChartLint(t *testing.T) {
	l := lint.All(chartDir, nil, namespace, false)
	for _, m := range l.Messages {
		if m.Severity > support.InfoSev {
			t.Errorf("helm lint: %s", m)
		} else {
			t.Logf("helm lint: %s", m)
		}
	}
	if l.HighestSeverity > support.InfoSev {
		t.Errorf("helm lint: highest severity %d", l.HighestSeverity)
	}
}

// release is the project's release version (the VERSION file at the repository's root).
func release(t *testing.T) string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("..", "VERSION"))
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(data))
}

// The release version has one source, VERSION; the chart's versions and every image reference
// of the manifests are that version, never a moving tag such as latest.
func TestVersionsArePinned(t *testing.T) {
	v := release(t)
	chart := loadChart(t)
	if chart.Metadata.AppVersion != v || chart.Metadata.Version != strings.TrimPrefix(v, "v") {
		t.Errorf("Chart.yaml: version %s, appVersion %s; VERSION is %s", chart.Metadata.Version, chart.Metadata.AppVersion, v)
	}
	for _, dir := range []string{"base", "cleanup"} {
		for k, o := range kustomize(t, dir) {
			spec, ok := at(o, "spec", "template", "spec").(map[string]any)
			if !ok {
				continue
			}
			for _, list := range []string{"initContainers", "containers"} {
				cs, _ := spec[list].([]any)
				for _, c := range cs {
					if image := at(c, "image").(string); !strings.HasSuffix(image, ":"+v) {
						t.Errorf("%s: image %s, want tag %s", k, image, v)
					}
				}
			}
		}
	}
}

// TestServiceAccountNamedTwice: every pod template that names a ServiceAccount names it in the
// deprecated serviceAccount too. The API server copies serviceAccountName into it; a rollback
// to a release without a ServiceAccount (helm rollback, kubectl apply) then drops
// serviceAccountName only, the alias keeps naming the ServiceAccount the rollback deleted, and
// the DaemonSet can create no pod (test/cluster's rollback found it).
func TestServiceAccountNamedTwice(t *testing.T) {
	// named says whether where must name one, so that the check is seen to look.
	check := func(where string, objs objects, named bool) {
		seen := false
		for k, o := range objs {
			spec, _ := at(o, "spec", "template", "spec").(map[string]any)
			if spec == nil {
				continue
			}
			name, alias := spec["serviceAccountName"], spec["serviceAccount"]
			seen = seen || name != nil
			if name != alias {
				t.Errorf("%s: %s: serviceAccountName %v, serviceAccount %v: want both the same", where, k, name, alias)
			}
		}
		if named && !seen {
			t.Errorf("%s: no pod template names a ServiceAccount: the check saw nothing", where)
		}
	}
	dirs, err := filepath.Glob("overlays/*")
	if err != nil {
		t.Fatal(err)
	}
	for _, dir := range append([]string{"base"}, dirs...) {
		check("kustomize "+dir, kustomize(t, dir), strings.HasPrefix(dir, "overlays/api-server"))
	}
	for _, values := range []string{"{}", "{configSource: crd, nodeStatus: {enabled: true}}", "configSource: configmap", "nodeStatus: {enabled: true}"} {
		var v map[string]any
		if err := yaml.Unmarshal([]byte(values), &v); err != nil {
			t.Fatal(err)
		}
		r, _, err := helmTemplate(t, v)
		if err != nil {
			t.Fatal(err)
		}
		check("chart with "+values, r, true)
	}
}
