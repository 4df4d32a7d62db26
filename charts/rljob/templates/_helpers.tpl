{{- define "rljob.fullname" -}}
{{- printf "%s-rljob-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rljob.serviceAccountName" -}}
{{- default (include "rljob.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "rljob.labels" -}}
app.kubernetes.io/name: rljob-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "rljob.selectorLabels" -}}
app.kubernetes.io/name: rljob-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rljob.webhookSecret" -}}
{{- printf "%s-webhook-tls" (include "rljob.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
